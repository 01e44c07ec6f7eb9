// Pure data transforms (unit-tested): the /experts byte grid, co-activation, profile
// phases, Brio verdicts, exports, formatting.
import type { ChatMessage, ExpertsSnapshot, SystemOneAnswer, Turn } from './api'

export const TIER_NAMES = ['disk', 'ram', 'pinned', 'tier 3'] as const
export type TierName = (typeof TIER_NAMES)[number]

export function base64Bytes(b64: string): Uint8Array {
  if (!b64) return new Uint8Array(0)
  const bin = atob(b64)
  const out = new Uint8Array(bin.length)
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i)
  return out
}

/** One expert's byte: the tier in the top 2 bits (0 disk, 1 RAM, 2 pinned), a 6-bit log2 heat below. */
export function decodeCell(byte: number): { tier: number; heat: number } {
  return { tier: (byte >> 6) & 3, heat: byte & 63 }
}

/** The lowest routing count a heat bucket stands for (heat = bit length of the count). */
export function heatMinCount(heat: number): number {
  return heat <= 0 ? 0 : 2 ** (heat - 1)
}

/** Bit i of a little-bit-order bitmap (numpy packbits bitorder="little"). */
export function bit(bits: Uint8Array, i: number): boolean {
  return ((bits[i >> 3] ?? 0) >> (i & 7)) & 1 ? true : false
}

export interface ExpertGrid {
  rows: number
  cols: number
  seq: number
  tier: Uint8Array // rows*cols
  heat: Uint8Array
  routed: Uint8Array // 0/1
  routedCount: number
  maxHeat: number
}

export function decodeExperts(s: ExpertsSnapshot): ExpertGrid {
  const n = s.rows * s.cols
  const bytes = base64Bytes(s.cells)
  if (bytes.length !== n) throw new Error(`/experts: ${bytes.length} cell bytes for a ${s.rows}x${s.cols} grid`)
  const bits = base64Bytes(s.routed)
  const tier = new Uint8Array(n)
  const heat = new Uint8Array(n)
  const routed = new Uint8Array(n)
  let routedCount = 0
  let maxHeat = 0
  for (let i = 0; i < n; i++) {
    const c = decodeCell(bytes[i])
    tier[i] = c.tier
    heat[i] = c.heat
    if (c.heat > maxHeat) maxHeat = c.heat
    if (bit(bits, i)) {
      routed[i] = 1
      routedCount++
    }
  }
  return { rows: s.rows, cols: s.cols, seq: s.seq, tier, heat, routed, routedCount, maxHeat }
}

/** Brightness 0.15..1 of a heat bucket relative to the hottest expert. */
export function brightness(heat: number, maxHeat: number): number {
  if (heat <= 0 || maxHeat <= 0) return 0.15
  return 0.15 + 0.85 * (heat / maxHeat)
}

export function tierCounts(g: ExpertGrid): number[] {
  const out = [0, 0, 0, 0]
  for (const t of g.tier) out[t]++
  return out
}

// ---- co-activation (computed here from successive /experts routed bitmaps) ------------------

export interface CoActivation {
  rows: number
  cols: number
  steps: number // snapshots with something routed
  fired: Float64Array // rows*cols: snapshots each expert was routed in
  pairs: Float64Array // rows*cols*cols: snapshots two experts of one layer were routed together
}

export function emptyCoActivation(rows: number, cols: number): CoActivation {
  return { rows, cols, steps: 0, fired: new Float64Array(rows * cols), pairs: new Float64Array(rows * cols * cols) }
}

/** Adds one snapshot (a new seq) to the history. Returns the same object, updated. */
export function addSnapshot(co: CoActivation, g: ExpertGrid): CoActivation {
  if (g.rows !== co.rows || g.cols !== co.cols || g.routedCount === 0) return co
  co.steps++
  const { cols } = co
  for (let r = 0; r < co.rows; r++) {
    const on: number[] = []
    for (let c = 0; c < cols; c++) if (g.routed[r * cols + c]) on.push(c)
    for (const a of on) {
      co.fired[r * cols + a]++
      for (const b of on) if (b !== a) co.pairs[(r * cols + a) * cols + b]++
    }
  }
  return co
}

/** Jaccard similarity of two experts of one layer: together / (either). */
export function jaccard(co: CoActivation, row: number, a: number, b: number): number {
  const cols = co.cols
  const both = co.pairs[(row * cols + a) * cols + b]
  const either = co.fired[row * cols + a] + co.fired[row * cols + b] - both
  return either > 0 ? both / either : 0
}

/** The experts that fire most often with expert `a` in layer `row`, best first. */
export function partners(co: CoActivation, row: number, a: number, k = 3): { expert: number; together: number }[] {
  const out: { expert: number; together: number }[] = []
  for (let b = 0; b < co.cols; b++) {
    if (b === a) continue
    const together = co.pairs[(row * co.cols + a) * co.cols + b]
    if (together > 0) out.push({ expert: b, together })
  }
  out.sort((x, y) => y.together - x.together || x.expert - y.expert)
  return out.slice(0, k)
}

// ---- profiling --------------------------------------------------------------------------------

export const PHASES = [
  { key: 'io_wait_seconds', label: 'I/O wait', color: 'var(--ph-io)' },
  { key: 'expert_matmul_seconds', label: 'expert matmul', color: 'var(--ph-matmul)' },
  { key: 'attention_seconds', label: 'attention', color: 'var(--ph-attn)' },
  { key: 'dense_mlp_seconds', label: 'dense MLP', color: 'var(--ph-dense)' },
  { key: 'lm_head_seconds', label: 'LM head', color: 'var(--ph-head)' },
  { key: 'other_seconds', label: 'other', color: 'var(--ph-other)' },
] as const

export interface PhaseSlice {
  key: string
  label: string
  color: string
  seconds: number
  fraction: number // of wall time
}

/** A turn's wall time split by phase; "other" is the wall time the named phases leave. */
export function phases(t: Turn): PhaseSlice[] {
  const wall = Math.max(t.wall_seconds, 1e-9)
  const named = PHASES.filter((p) => p.key !== 'other_seconds').reduce(
    (s, p) => s + (Number((t as any)[p.key]) || 0),
    0,
  )
  return PHASES.map((p) => {
    const seconds =
      p.key === 'other_seconds' ? Math.max(0, t.other_seconds ?? wall - named) : Number((t as any)[p.key]) || 0
    return { ...p, seconds, fraction: Math.min(1, seconds / wall) }
  })
}

export function lastTurns(turns: Turn[], n = 30): Turn[] {
  return turns.slice(Math.max(0, turns.length - n))
}

export function turnTokPerSec(t: Turn): number | null {
  if (t.tokens_per_second != null) return t.tokens_per_second
  return t.wall_seconds > 0 && t.completion_tokens > 0 ? t.completion_tokens / t.wall_seconds : null
}

export interface Speculation {
  drafted: number
  accepted: number
  acceptance: number | null // accepted / drafted; null when nothing was drafted
  tokensPerStep: number | null // output tokens per step that yielded any
}

/** Speculative decoding over some turns (/profile's draft_tokens, accepted_tokens). Each step
 * that yields output samples one token of its own plus the drafts it accepted, so the steps
 * are completion_tokens - accepted_tokens and the mean tokens per step is completion over
 * that (1 without speculation). */
export function speculation(turns: Turn[]): Speculation {
  let drafted = 0
  let accepted = 0
  let completion = 0
  for (const t of turns) {
    drafted += t.draft_tokens || 0
    accepted += t.accepted_tokens || 0
    completion += t.completion_tokens || 0
  }
  return {
    drafted,
    accepted,
    acceptance: drafted > 0 ? accepted / drafted : null,
    tokensPerStep: completion > accepted ? completion / (completion - accepted) : null,
  }
}

/** "62.5%", or "—" when nothing was drafted. */
export function formatAcceptance(a: number | null): string {
  return a == null ? '—' : `${(100 * a).toFixed(1)}%`
}

// ---- Brio ---------------------------------------------------------------------------------------

export type Verdict = 'confident' | 'unsure' | 'not sure'

/** Normalised entropy (0..1): below 0.4 reads as confident, above 0.8 as "does not know". */
export function verdict(entropy: number): Verdict {
  if (entropy < 0.4) return 'confident'
  if (entropy <= 0.8) return 'unsure'
  return 'not sure'
}

export function normalisedEntropy(p: number[]): number {
  if (p.length < 2) return 0
  const h = -p.reduce((s, x) => (x > 0 ? s + x * Math.log(x) : s), 0)
  return h <= 0 ? 0 : h / Math.log(p.length)
}

export function parseOptions(text: string): string[] {
  const seen = new Set<string>()
  const out: string[] = []
  for (const line of text.split('\n')) {
    const o = line.trim()
    if (o && !seen.has(o)) {
      seen.add(o)
      out.push(o)
    }
  }
  return out
}

// ---- typed decisions (/v1/systemone) -------------------------------------------------------------

export type DecisionKind = 'noul' | 'choice' | 'score'

/** A question as the form holds it: choice options and score levels one per line
 *  ("name: description" gives an option a description); noul sides may be empty. */
export interface DecisionDraft {
  id: string
  kind: DecisionKind
  instructions: string
  lines: string
  yes: string
  no: string
}

/** The wire form of a draft question, or a sentence saying what is missing. */
export function decisionQuestion(d: DecisionDraft): Record<string, unknown> | string {
  const instructions = d.instructions.trim()
  if (d.kind === 'noul') {
    const criteria: Record<string, string> = {}
    if (d.yes.trim()) criteria.true = d.yes.trim()
    if (d.no.trim()) criteria.false = d.no.trim()
    if (!instructions && !Object.keys(criteria).length) return 'a yes/no question needs a question or a description of yes or no'
    const q: Record<string, unknown> = { type: 'noul' }
    if (instructions) q.instructions = instructions
    if (Object.keys(criteria).length) q.criteria = criteria
    return q
  }
  const lines = parseOptions(d.lines)
  if (d.kind === 'choice') {
    if (lines.length < 2 || lines.length > 255) return 'a choice needs 2 to 255 options'
    const criteria: Record<string, string | null> = {}
    for (const line of lines) {
      const at = line.indexOf(': ')
      if (at > 0) criteria[line.slice(0, at).trim()] = line.slice(at + 2).trim() || null
      else criteria[line] = null
    }
    return { type: 'choice', ...(instructions ? { instructions } : {}), criteria }
  }
  if (lines.length < 2 || lines.length > 10) return 'a score needs 2 to 10 levels'
  return { type: 'score', ...(instructions ? { instructions } : {}), criteria: lines }
}

/** An answer's outcomes as (label, probability), likeliest first for a choice, in level order for a score. */
export function answerBars(a: SystemOneAnswer): [string, number][] {
  if (a.type === 'noul') return [['yes', a.noul], ['no', 1 - a.noul]]
  const rows = Object.entries(a.probabilities)
  if (a.type === 'choice') return rows.sort((x, y) => y[1] - x[1])
  return rows.map(([k, p]) => [`${k} · ${typeof a.legend[k] === 'string' ? a.legend[k] : JSON.stringify(a.legend[k])}`, p])
}

// ---- chat export --------------------------------------------------------------------------------

export interface Turnout extends ChatMessage {
  reasoning?: string
  stats?: { ttftMs?: number; tokPerSec?: number; queueWaitMs?: number; tokens?: number }
}

export function toMarkdown(model: string, messages: Turnout[], date = new Date()): string {
  const lines = [`# Conversation with ${model || 'the model'}`, '', `_Exported ${date.toISOString()}_`, '']
  for (const m of messages) {
    const who = m.role === 'user' ? 'You' : m.role === 'assistant' ? 'Assistant' : 'System'
    lines.push(`## ${who}`, '')
    if (m.reasoning) {
      lines.push('<details><summary>Reasoning</summary>', '', m.reasoning.trim(), '', '</details>', '')
    }
    lines.push(m.content.trim(), '')
  }
  return lines.join('\n')
}

export function toJSON(model: string, messages: Turnout[], date = new Date()): string {
  return JSON.stringify({ model, exported_at: date.toISOString(), messages }, null, 2)
}

// ---- formatting -----------------------------------------------------------------------------------

export function formatBytes(n: number | null | undefined): string {
  if (n == null || !isFinite(n)) return '–'
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB']
  let i = 0
  let v = n
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024
    i++
  }
  return `${v < 10 && i > 0 ? v.toFixed(1) : Math.round(v)} ${units[i]}`
}

export function formatSeconds(s: number): string {
  if (s < 1e-3) return `${(s * 1e6).toFixed(0)} µs`
  if (s < 1) return `${(s * 1e3).toFixed(s < 0.01 ? 2 : 1)} ms`
  return `${s.toFixed(2)} s`
}

/** RAM vs disk bytes of the model, from /health's memory or a stats frame's resident_bytes. */
export function tierBytes(
  memory?: Record<string, number> | null,
): { ram: number; pinned: number; disk: number; dense: number } | null {
  if (!memory) return null
  const dense = memory.dense_bytes ?? memory.dense ?? 0
  const pinned = memory.experts_pinned_bytes ?? memory.pinned ?? 0
  const ram = memory.experts_ram_bytes ?? memory.cached ?? 0
  const disk = memory.experts_disk_bytes ?? memory.disk ?? 0
  return { dense, pinned, ram, disk }
}
