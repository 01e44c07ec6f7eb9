import { useEffect, useRef, useState } from 'react'
import { streamChat } from '../api'
import type { EngineStats } from '../api'
import { useStore } from '../store'
import { formatBytes, tierBytes, toJSON, toMarkdown } from '../transforms'
import type { Turnout } from '../transforms'

interface Live {
  startedAt: number
  firstAt?: number
  tokens: number
  queueWaitMs?: number
}

function download(name: string, type: string, text: string) {
  const blob = new Blob([text], { type })
  const a = document.createElement('a')
  a.href = URL.createObjectURL(blob)
  a.download = name
  document.body.appendChild(a)
  a.click()
  a.remove()
  setTimeout(() => URL.revokeObjectURL(a.href), 1000)
}

export function TierBar({ memory }: { memory?: Record<string, number> | null }) {
  const t = tierBytes(memory)
  if (!t) return null
  const ramTotal = t.dense + t.pinned + t.ram
  const total = ramTotal + t.disk || 1
  const parts = [
    { label: 'dense (RAM)', bytes: t.dense, cls: 'tier-dense' },
    { label: 'experts pinned', bytes: t.pinned, cls: 'tier-pinned' },
    { label: 'experts in RAM', bytes: t.ram, cls: 'tier-ram' },
    { label: 'experts on disk', bytes: t.disk, cls: 'tier-disk' },
  ]
  return (
    <div className="tierbar" data-testid="tierbar" title="Where the model's bytes live">
      <div className="tierbar-track" role="img" aria-label={`RAM ${formatBytes(ramTotal)}, disk ${formatBytes(t.disk)}`}>
        {parts.map((p) =>
          p.bytes > 0 ? (
            <span key={p.cls} className={p.cls} style={{ width: `${(100 * p.bytes) / total}%` }} title={`${p.label}: ${formatBytes(p.bytes)}`} />
          ) : null,
        )}
      </div>
      <span className="tierbar-legend">
        RAM {formatBytes(ramTotal)} · disk {formatBytes(t.disk)}
      </span>
    </div>
  )
}

export function Chat() {
  const store = useStore()
  const { settings, coli, model, health, setGenerating, beginActivity, onError } = store
  const [messages, setMessages] = useState<Turnout[]>([])
  const [input, setInput] = useState('')
  const [system, setSystem] = useState('')
  const [reasoning, setReasoning] = useState(false)
  const [slot, setSlot] = useState<number | null>(null)
  const [maxTokens, setMaxTokens] = useState(256)
  const [busy, setBusy] = useState(false)
  const [error, setError] = useState('')
  const [live, setLive] = useState<Live | null>(null)
  const [stats, setStats] = useState<EngineStats | null>(null)
  const [now, setNow] = useState(0)
  const abortRef = useRef<AbortController | null>(null)
  const endRef = useRef<HTMLDivElement>(null)

  useEffect(() => {
    endRef.current?.scrollIntoView({ block: 'end' })
  }, [messages])

  useEffect(() => {
    if (!busy) return
    const t = setInterval(() => setNow(performance.now()), 250)
    return () => clearInterval(t)
  }, [busy])

  const slots = health?.slots?.length ?? health?.capacity ?? 0

  async function send() {
    const text = input.trim()
    if (!text || busy) return
    setError('')
    const history: Turnout[] = [...messages, { role: 'user', content: text }]
    const assistant: Turnout = { role: 'assistant', content: '', reasoning: '', stats: {} }
    setMessages([...history, assistant])
    setInput('')
    setBusy(true)
    beginActivity(text)
    setGenerating(true)
    const ctl = new AbortController()
    abortRef.current = ctl
    const l: Live = { startedAt: performance.now(), tokens: 0 }
    setLive({ ...l })
    const update = () => {
      const elapsed = l.firstAt ? (performance.now() - l.firstAt) / 1000 : 0
      assistant.stats = {
        ttftMs: l.firstAt ? Math.round(l.firstAt - l.startedAt) : undefined,
        tokPerSec: elapsed > 0 && l.tokens > 1 ? (l.tokens - 1) / elapsed : undefined,
        queueWaitMs: l.queueWaitMs,
        tokens: l.tokens,
      }
      setMessages([...history, { ...assistant }])
      setLive({ ...l })
    }
    const wire = [
      ...(system.trim() ? [{ role: 'system' as const, content: system.trim() }] : []),
      ...history.map((m) => ({ role: m.role, content: m.content })),
    ]
    try {
      await streamChat(
        settings,
        { model, messages: wire, coli, cacheSlot: slot, reasoning, maxTokens },
        (ev) => {
          if (ev.type === 'content' || ev.type === 'reasoning') {
            if (!l.firstAt) l.firstAt = performance.now()
            l.tokens++
            if (ev.type === 'content') assistant.content += ev.text
            else assistant.reasoning = (assistant.reasoning ?? '') + ev.text
            update()
          } else if (ev.type === 'stats') {
            setStats(ev.stats)
          } else if (ev.type === 'usage') {
            const n = Number((ev.usage as any).completion_tokens)
            if (n > 0) l.tokens = n
            update()
          } else if (ev.type === 'error') {
            setError(ev.message)
          }
        },
        ctl.signal,
        (res) => {
          const q = res.headers.get('x-colibri-queue-wait-ms')
          if (q !== null) l.queueWaitMs = Number(q)
          update()
        },
      )
    } catch (e) {
      const msg = onError(e)
      if (msg === 'stopped') assistant.content += assistant.content ? ' …' : '…'
      else setError(msg)
    } finally {
      update()
      abortRef.current = null
      setBusy(false)
      setGenerating(false)
      store.refreshProfile()
    }
  }

  function stop() {
    abortRef.current?.abort()
  }

  const last = messages[messages.length - 1]
  const liveStats = last?.role === 'assistant' ? last.stats : undefined
  const waitingFirst = busy && live && !live.firstAt
  const memory = (health?.memory as Record<string, number> | undefined) ?? stats?.resident_bytes ?? null
  void now

  return (
    <section className="page chat" aria-label="Chat">
      <div className="toolbar">
        <label className="field">
          <span>KV slot</span>
          <select
            data-testid="slot"
            value={slot === null ? 'any' : String(slot)}
            onChange={(e) => setSlot(e.target.value === 'any' ? null : Number(e.target.value))}
            disabled={!coli}
            title={coli ? 'cache_slot: the KV context this conversation answers in' : 'colibri servers only'}
          >
            <option value="any">any</option>
            {Array.from({ length: Math.max(slots, 1) }, (_, i) => (
              <option key={i} value={i}>
                {i}
                {health?.slots?.[i] ? ` (${health.slots[i].tokens} tok${health.slots[i].busy ? ', busy' : ''})` : ''}
              </option>
            ))}
          </select>
        </label>
        <label className="field check">
          <input type="checkbox" data-testid="reasoning" checked={reasoning} onChange={(e) => setReasoning(e.target.checked)} />
          <span>Reasoning</span>
        </label>
        <label className="field">
          <span>Max tokens</span>
          <input
            type="number"
            min={1}
            max={32768}
            value={maxTokens}
            onChange={(e) => setMaxTokens(Math.max(1, Number(e.target.value) || 1))}
            className="num"
          />
        </label>
        <span className="spacer" />
        <button type="button" onClick={() => download('conversation.md', 'text/markdown', toMarkdown(model, messages))} disabled={!messages.length}>
          Export .md
        </button>
        <button type="button" onClick={() => download('conversation.json', 'application/json', toJSON(model, messages))} disabled={!messages.length}>
          Export .json
        </button>
        <button type="button" onClick={() => setMessages([])} disabled={busy || !messages.length}>
          Clear
        </button>
      </div>
      <div className="statline" data-testid="chat-stats" aria-live="off">
        <span>
          tok/s <b data-testid="tps">{liveStats?.tokPerSec ? liveStats.tokPerSec.toFixed(1) : '–'}</b>
        </span>
        <span>
          TTFT <b data-testid="ttft">{liveStats?.ttftMs != null ? `${liveStats.ttftMs} ms` : waitingFirst ? '…' : '–'}</b>
        </span>
        <span>
          queue <b data-testid="queue">{liveStats?.queueWaitMs != null ? `${liveStats.queueWaitMs} ms` : '–'}</b>
        </span>
        {stats?.expert_hit_rate != null && (
          <span>
            hit rate <b>{(100 * stats.expert_hit_rate).toFixed(1)}%</b>
          </span>
        )}
        <TierBar memory={memory} />
      </div>
      <details className="system">
        <summary>System prompt</summary>
        <textarea value={system} onChange={(e) => setSystem(e.target.value)} rows={2} placeholder="Optional instructions for the model" />
      </details>
      <div className="transcript" data-testid="transcript" aria-live="polite">
        {!messages.length && <p className="hint">Ask something. Answers stream in as the model writes them.</p>}
        {messages.map((m, i) => (
          <article key={i} className={`msg ${m.role}`} data-testid={`msg-${m.role}`}>
            <header>{m.role === 'user' ? 'You' : 'Assistant'}</header>
            {m.reasoning ? (
              <details className="reasoning" data-testid="reasoning-block" open={busy && i === messages.length - 1}>
                <summary>Reasoning</summary>
                <div className="text">{m.reasoning}</div>
              </details>
            ) : null}
            <div className="text">
              {m.content}
              {busy && i === messages.length - 1 && <span className="caret" aria-hidden="true" />}
            </div>
            {m.role === 'assistant' && m.stats?.tokens ? (
              <footer>
                {m.stats.tokens} tokens
                {m.stats.tokPerSec ? ` · ${m.stats.tokPerSec.toFixed(1)} tok/s` : ''}
                {m.stats.ttftMs != null ? ` · TTFT ${m.stats.ttftMs} ms` : ''}
              </footer>
            ) : null}
          </article>
        ))}
        <div ref={endRef} />
      </div>
      {error && (
        <p className="error" role="alert" data-testid="chat-error">
          {error}
        </p>
      )}
      <form
        className="composer"
        onSubmit={(e) => {
          e.preventDefault()
          send()
        }}
      >
        <textarea
          data-testid="chat-input"
          aria-label="Message"
          value={input}
          rows={2}
          placeholder="Message (Enter to send, Shift+Enter for a new line)"
          onChange={(e) => setInput(e.target.value)}
          onKeyDown={(e) => {
            if (e.key === 'Enter' && !e.shiftKey && !e.nativeEvent.isComposing) {
              e.preventDefault()
              send()
            }
          }}
        />
        {busy ? (
          <button type="button" className="stop" data-testid="stop" onClick={stop}>
            Stop
          </button>
        ) : (
          <button type="submit" className="primary" data-testid="send" disabled={!input.trim()}>
            Send
          </button>
        )}
      </form>
    </section>
  )
}
