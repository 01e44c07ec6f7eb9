import { afterEach, describe, expect, it, vi } from 'vitest'
import { ApiError, chatBody, chunkEvents, getJSON, headers, postJSON, SSEParser, streamChat, url } from './api'
import type { StreamEvent } from './api'

const settings = { baseUrl: '', apiKey: '', model: '' }

afterEach(() => vi.unstubAllGlobals())

describe('addresses and headers', () => {
  it('joins the base URL, tolerating a trailing slash or /v1', () => {
    expect(url({ baseUrl: '' }, '/health')).toBe('/health')
    expect(url({ baseUrl: 'http://h:1/' }, '/v1/models')).toBe('http://h:1/v1/models')
    expect(url({ baseUrl: 'https://api.example.com/v1' }, '/v1/models')).toBe('https://api.example.com/v1/models')
  })

  it('sends the API key as a bearer token', () => {
    expect(headers({ apiKey: '' })).toEqual({})
    expect(headers({ apiKey: 'k' }, true)).toEqual({ Authorization: 'Bearer k', 'Content-Type': 'application/json' })
  })
})

describe('SSE', () => {
  it('splits frames across arbitrary chunk boundaries', () => {
    const p = new SSEParser()
    expect(p.push('data: {"a"')).toEqual([])
    expect(p.push(':1}\n\n: keepalive\n\ndata: [DO')).toEqual(['{"a":1}'])
    expect(p.push('NE]\r\n\r\n')).toEqual(['[DONE]'])
  })

  it('turns chunks into events and ignores what it does not know', () => {
    const c = (delta: object, finish: string | null = null) =>
      JSON.stringify({ object: 'chat.completion.chunk', choices: [{ index: 0, delta, finish_reason: finish }] })
    expect(chunkEvents(c({ role: 'assistant', content: '' }))).toEqual([])
    expect(chunkEvents(c({ content: 'Hi' }))).toEqual([{ type: 'content', text: 'Hi' }])
    expect(chunkEvents(c({ reasoning_content: 'hm', reasoning: 'hm' }))).toEqual([{ type: 'reasoning', text: 'hm' }])
    expect(chunkEvents(c({}, 'stop'))).toEqual([{ type: 'finish', reason: 'stop' }])
    expect(chunkEvents('{"x_colibri_stats":{"tokens_per_second":5}}')).toEqual([
      { type: 'stats', stats: { tokens_per_second: 5 } },
    ])
    expect(chunkEvents('{"choices":[],"usage":{"completion_tokens":3}}')).toEqual([
      { type: 'usage', usage: { completion_tokens: 3 } },
    ])
    expect(chunkEvents('{"error":{"message":"boom"}}')).toEqual([{ type: 'error', message: 'boom' }])
    expect(chunkEvents('{"something":"else"}')).toEqual([])
    expect(chunkEvents('not json')).toEqual([])
    expect(chunkEvents('[DONE]')).toBe('done')
  })
})

describe('request bodies', () => {
  const messages = [{ role: 'user' as const, content: 'Hi' }]

  it('sends colibri extensions only to colibri', () => {
    const coli = chatBody({ model: 'm', messages, coli: true, cacheSlot: 1, reasoning: true, maxTokens: 9 })
    expect(coli).toMatchObject({
      model: 'm',
      stream: true,
      max_tokens: 9,
      cache_slot: 1,
      chat_template_kwargs: { enable_thinking: true },
      stream_options: { include_usage: true, x_colibri_stats: true },
    })
    const other = chatBody({ model: 'gpt', messages, coli: false, cacheSlot: 1, reasoning: true })
    expect(other).toEqual({ model: 'gpt', messages, stream: true, stream_options: { include_usage: true } })
  })

  it('leaves the slot to the server when none is chosen', () => {
    expect(chatBody({ model: '', messages, coli: true, cacheSlot: null })).not.toHaveProperty('cache_slot')
  })
})

function sseResponse(frames: string[], init: ResponseInit = {}) {
  const enc = new TextEncoder()
  const body = new ReadableStream({
    start(c) {
      for (const f of frames) c.enqueue(enc.encode(f))
      c.close()
    },
  })
  return new Response(body, { status: 200, headers: { 'content-type': 'text/event-stream', ...(init.headers ?? {}) } })
}

describe('fetching', () => {
  it('streams a chat completion', async () => {
    const fetchMock = vi.fn(async () =>
      sseResponse(
        [
          'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
          'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\ndata: {"choices":[{"index":0,"delta":{"con',
          'tent":"lo"}}]}\n\n',
          'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
          'data: [DONE]\n\n',
          'data: {"choices":[{"index":0,"delta":{"content":"after done"}}]}\n\n',
        ],
        { headers: { 'x-colibri-queue-wait-ms': '12' } },
      ),
    )
    vi.stubGlobal('fetch', fetchMock)
    const events: StreamEvent[] = []
    let wait: string | null = null
    await streamChat(
      { ...settings, apiKey: 'k' },
      { model: 'm', messages: [{ role: 'user', content: 'Hi' }], coli: true },
      (e) => events.push(e),
      new AbortController().signal,
      (res) => (wait = res.headers.get('x-colibri-queue-wait-ms')),
    )
    expect(events).toEqual([
      { type: 'content', text: 'Hel' },
      { type: 'content', text: 'lo' },
      { type: 'finish', reason: 'stop' },
    ])
    expect(wait).toBe('12')
    const [u, init] = fetchMock.mock.calls[0] as unknown as [string, RequestInit]
    expect(u).toBe('/v1/chat/completions')
    expect((init.headers as Record<string, string>).Authorization).toBe('Bearer k')
    expect(JSON.parse(init.body as string).stream).toBe(true)
  })

  it('turns an error envelope into an ApiError with its status and message', async () => {
    vi.stubGlobal(
      'fetch',
      vi.fn(async () =>
        new Response(JSON.stringify({ error: { message: 'a valid API key is required', code: 'invalid_api_key' } }), {
          status: 401,
        }),
      ),
    )
    const err = (await getJSON(settings, '/experts').catch((e) => e)) as ApiError
    expect(err).toBeInstanceOf(ApiError)
    expect(err.status).toBe(401)
    expect(err.code).toBe('invalid_api_key')
    expect(err.message).toBe('a valid API key is required')
  })

  it('posts JSON', async () => {
    const fetchMock = vi.fn(async () => new Response('{"answer":"yes"}', { status: 200 }))
    vi.stubGlobal('fetch', fetchMock)
    const { data } = await postJSON<{ answer: string }>(settings, '/v1/brio', { options: ['yes', 'no'] })
    expect(data.answer).toBe('yes')
    const [, init] = fetchMock.mock.calls[0] as unknown as [string, RequestInit]
    expect(init.method).toBe('POST')
    expect((init.headers as Record<string, string>)['Content-Type']).toBe('application/json')
  })
})
