// The dashboard's only way to the engine: its HTTP API (OpenAI endpoints + /health,
// /experts, /profile, /v1/brio). Works against any OpenAI-compatible endpoint for chat.

export interface Settings {
  baseUrl: string // '' = the server that served this page
  apiKey: string
  model: string // '' = the first of /v1/models
}

export class ApiError extends Error {
  constructor(
    public status: number,
    message: string,
    public code?: string,
  ) {
    super(message)
    this.name = 'ApiError'
  }
}

export function url(settings: Pick<Settings, 'baseUrl'>, path: string): string {
  const base = settings.baseUrl.trim().replace(/\/+$/, '').replace(/\/v1$/, '')
  return base + path
}

export function headers(settings: Pick<Settings, 'apiKey'>, json = false): Record<string, string> {
  const h: Record<string, string> = {}
  if (json) h['Content-Type'] = 'application/json'
  if (settings.apiKey) h['Authorization'] = `Bearer ${settings.apiKey}`
  return h
}

async function failure(res: Response): Promise<ApiError> {
  let message = `${res.status} ${res.statusText}`
  let code: string | undefined
  try {
    const body = await res.json()
    const err = body?.error
    if (err?.message) message = err.message
    if (err?.code) code = err.code
  } catch {
    /* not JSON */
  }
  return new ApiError(res.status, message, code)
}

export async function getJSON<T>(settings: Settings, path: string, signal?: AbortSignal): Promise<T> {
  const res = await fetch(url(settings, path), { headers: headers(settings), signal })
  if (!res.ok) throw await failure(res)
  return (await res.json()) as T
}

export async function postJSON<T>(
  settings: Settings,
  path: string,
  body: unknown,
  signal?: AbortSignal,
): Promise<{ data: T; response: Response }> {
  const res = await fetch(url(settings, path), {
    method: 'POST',
    headers: headers(settings, true),
    body: JSON.stringify(body),
    signal,
  })
  if (!res.ok) throw await failure(res)
  return { data: (await res.json()) as T, response: res }
}

// ---- shapes --------------------------------------------------------------------------------

export interface Health {
  status: string
  active?: number
  queued?: number
  capacity?: number
  slots?: { slot: number; busy: boolean; tokens: number }[]
  model?: string
  context?: number
  memory?: {
    dense_bytes: number
    experts_pinned_bytes: number
    experts_ram_bytes: number
    experts_disk_bytes: number
  }
  hardware?: { threads: number; cpus: number; simd: string }
  [k: string]: unknown
}

export interface ExpertsSnapshot {
  rows: number
  cols: number
  seq: number
  cells: string // base64, one byte per expert: tier << 6 | heat
  routed: string // base64 bitmap (little bit order), experts routed in the latest step
  routed_tokens?: number
  tiers?: Record<string, string>
}

export interface Turn {
  finished_at: number
  wall_seconds: number
  prompt_tokens: number
  cached_tokens?: number
  completion_tokens: number
  forward_passes: number
  disk_seconds: number
  io_wait_seconds: number
  expert_matmul_seconds: number
  attention_seconds: number
  dense_mlp_seconds?: number
  lm_head_seconds: number
  other_seconds: number
  tokens_per_second?: number | null
  bytes_read?: number
  experts_needed?: number
  experts_hit?: number
  draft_tokens?: number // speculative decoding: draft tokens verified
  accepted_tokens?: number // ... and accepted (completion_tokens counts them)
}

export interface ProfileData {
  window: number
  turns: Turn[]
  totals?: Record<string, number>
}

export interface BrioChoice {
  option: string
  p: number
  logprob: number
  mean_logprob: number
  tokens: number
}

export interface BrioResult {
  object: string
  answer: string
  entropy: number
  normalize: string
  choices: BrioChoice[]
  usage?: Record<string, number>
}

/** /v1/systemone (TypeSafe's Jev API): one answer per question id. */
export type SystemOneAnswer =
  | { type: 'noul'; noul: number }
  | { type: 'choice'; choice: string; probabilities: Record<string, number>; confidence: number }
  | { type: 'score'; score: number; confidence: number; legend: Record<string, unknown>; probabilities: Record<string, number> }

export interface SystemOneResult {
  model: string
  answers: Record<string, SystemOneAnswer>
  usage: { input_tokens: number; output_tokens: number }
}

export interface ChatMessage {
  role: 'system' | 'user' | 'assistant'
  content: string
}

export interface EngineStats {
  tokens_per_second?: number | null
  expert_hit_rate?: number | null
  resident_bytes?: Record<string, number>
  completion_tokens?: number
}

export type StreamEvent =
  | { type: 'content'; text: string }
  | { type: 'reasoning'; text: string }
  | { type: 'finish'; reason: string }
  | { type: 'usage'; usage: Record<string, unknown> }
  | { type: 'stats'; stats: EngineStats }
  | { type: 'error'; message: string }

// ---- SSE -----------------------------------------------------------------------------------

/** Splits an SSE byte stream's text into the data payloads of complete frames. */
export class SSEParser {
  private buf = ''

  push(text: string): string[] {
    this.buf += text.replace(/\r\n?/g, '\n')
    const out: string[] = []
    let end: number
    while ((end = this.buf.indexOf('\n\n')) >= 0) {
      const frame = this.buf.slice(0, end)
      this.buf = this.buf.slice(end + 2)
      const data = frame
        .split('\n')
        .filter((l) => l.startsWith('data:'))
        .map((l) => l.slice(5).replace(/^ /, ''))
      if (data.length) out.push(data.join('\n'))
    }
    return out
  }
}

/** The events of one chat.completion.chunk payload (unknown frames are ignored). */
export function chunkEvents(payload: string): StreamEvent[] | 'done' {
  if (payload === '[DONE]') return 'done'
  let obj: any
  try {
    obj = JSON.parse(payload)
  } catch {
    return []
  }
  const out: StreamEvent[] = []
  if (obj?.error) {
    out.push({ type: 'error', message: String(obj.error.message ?? obj.error) })
    return out
  }
  if (obj?.x_colibri_stats) out.push({ type: 'stats', stats: obj.x_colibri_stats })
  for (const choice of obj?.choices ?? []) {
    if ((choice.index ?? 0) !== 0) continue
    const d = choice.delta ?? {}
    const reasoning = d.reasoning_content ?? d.reasoning
    if (typeof reasoning === 'string' && reasoning) out.push({ type: 'reasoning', text: reasoning })
    if (typeof d.content === 'string' && d.content) out.push({ type: 'content', text: d.content })
    if (choice.finish_reason) out.push({ type: 'finish', reason: choice.finish_reason })
  }
  if (obj?.usage) out.push({ type: 'usage', usage: obj.usage })
  return out
}

export interface ChatOptions {
  model: string
  messages: ChatMessage[]
  coli: boolean // the server is colibri: send its extensions (cache_slot, stats, thinking)
  cacheSlot?: number | null
  reasoning?: boolean
  maxTokens?: number
  temperature?: number
}

export function chatBody(o: ChatOptions): Record<string, unknown> {
  const body: Record<string, unknown> = { messages: o.messages, stream: true }
  if (o.model) body.model = o.model
  if (o.maxTokens) body.max_tokens = o.maxTokens
  if (o.temperature !== undefined) body.temperature = o.temperature
  if (o.coli) {
    body.stream_options = { include_usage: true, x_colibri_stats: true }
    if (o.cacheSlot !== null && o.cacheSlot !== undefined) body.cache_slot = o.cacheSlot
    body.chat_template_kwargs = { enable_thinking: !!o.reasoning }
  } else {
    body.stream_options = { include_usage: true }
  }
  return body
}

/** Streams one chat completion; calls onStart with the response (headers) and onEvent per event. */
export async function streamChat(
  settings: Settings,
  options: ChatOptions,
  onEvent: (e: StreamEvent) => void,
  signal: AbortSignal,
  onStart?: (res: Response) => void,
): Promise<void> {
  const res = await fetch(url(settings, '/v1/chat/completions'), {
    method: 'POST',
    headers: headers(settings, true),
    body: JSON.stringify(chatBody(options)),
    signal,
  })
  if (!res.ok) throw await failure(res)
  onStart?.(res)
  if (!res.body) throw new ApiError(0, 'the response has no body')
  const reader = res.body.getReader()
  const decoder = new TextDecoder()
  const parser = new SSEParser()
  for (;;) {
    const { value, done } = await reader.read()
    if (done) break
    for (const payload of parser.push(decoder.decode(value, { stream: true }))) {
      const events = chunkEvents(payload)
      if (events === 'done') return
      events.forEach(onEvent)
    }
  }
}
