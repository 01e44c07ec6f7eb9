import { describe, expect, it } from 'vitest'
import {
  addSnapshot,
  answerBars,
  decisionQuestion,
  base64Bytes,
  bit,
  brightness,
  decodeCell,
  decodeExperts,
  emptyCoActivation,
  formatAcceptance,
  formatBytes,
  heatMinCount,
  jaccard,
  lastTurns,
  normalisedEntropy,
  parseOptions,
  partners,
  phases,
  speculation,
  tierBytes,
  tierCounts,
  toJSON,
  toMarkdown,
  verdict,
} from './transforms'
import type { Turn } from './api'

const b64 = (bytes: number[]) => btoa(String.fromCharCode(...bytes))

/** What the server does: numpy packbits(bitorder="little"). */
function packLittle(bits: number[]): number[] {
  const out = new Array(Math.ceil(bits.length / 8)).fill(0)
  bits.forEach((b, i) => {
    if (b) out[i >> 3] |= 1 << (i & 7)
  })
  return out
}

describe('expert cells', () => {
  it('splits tier (top 2 bits) and heat (low 6 bits)', () => {
    expect(decodeCell(0)).toEqual({ tier: 0, heat: 0 })
    expect(decodeCell((1 << 6) | 5)).toEqual({ tier: 1, heat: 5 })
    expect(decodeCell((2 << 6) | 63)).toEqual({ tier: 2, heat: 63 })
    expect(decodeCell(0xff)).toEqual({ tier: 3, heat: 63 })
  })

  it('heat is the bit length of the routing count', () => {
    expect(heatMinCount(0)).toBe(0)
    expect(heatMinCount(1)).toBe(1)
    expect(heatMinCount(7)).toBe(64) // counts 64..127
  })

  it('reads little-bit-order bitmaps', () => {
    const bits = new Uint8Array(packLittle([1, 0, 0, 1, 0, 0, 0, 0, 0, 1]))
    expect([0, 1, 2, 3, 8, 9, 10].map((i) => bit(bits, i))).toEqual([true, false, false, true, false, true, false])
  })

  it('decodes a /experts snapshot', () => {
    const cells = [0x40 | 3, 0x40, 0x00 | 1, 0x80 | 6, 0x40 | 2, 0x40 | 2]
    const g = decodeExperts({ rows: 2, cols: 3, seq: 9, cells: b64(cells), routed: b64(packLittle([1, 0, 0, 0, 1, 1])) })
    expect(g.rows).toBe(2)
    expect(Array.from(g.tier)).toEqual([1, 1, 0, 2, 1, 1])
    expect(Array.from(g.heat)).toEqual([3, 0, 1, 6, 2, 2])
    expect(Array.from(g.routed)).toEqual([1, 0, 0, 0, 1, 1])
    expect(g.routedCount).toBe(3)
    expect(g.maxHeat).toBe(6)
    expect(tierCounts(g)).toEqual([1, 4, 1, 0])
  })

  it('matches the real server payload of the built-in model', () => {
    // GET /experts of a fresh `coli serve` on coli/default_model: 4 layers x 8 experts in RAM
    const g = decodeExperts({ rows: 4, cols: 8, seq: 0, cells: 'QEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEA=', routed: 'AAAAAA==' })
    expect(tierCounts(g)).toEqual([0, 32, 0, 0])
    expect(g.routedCount).toBe(0)
  })

  it('refuses a grid whose byte count is wrong', () => {
    expect(() => decodeExperts({ rows: 2, cols: 2, seq: 0, cells: b64([1, 2, 3]), routed: '' })).toThrow(/3 cell bytes/)
  })

  it('brightness grows with heat and stays visible when cold', () => {
    expect(brightness(0, 10)).toBeCloseTo(0.15)
    expect(brightness(10, 10)).toBe(1)
    expect(brightness(5, 10)).toBeGreaterThan(brightness(4, 10))
  })

  it('base64 of nothing is no bytes', () => {
    expect(base64Bytes('').length).toBe(0)
  })
})

describe('co-activation', () => {
  const snap = (seq: number, routed: number[]) =>
    decodeExperts({ rows: 2, cols: 3, seq, cells: b64([0x40, 0x40, 0x40, 0x40, 0x40, 0x40]), routed: b64(packLittle(routed)) })

  it('counts experts routed in the same step, per layer', () => {
    const co = emptyCoActivation(2, 3)
    addSnapshot(co, snap(1, [1, 1, 0, 0, 1, 1]))
    addSnapshot(co, snap(2, [1, 0, 1, 0, 1, 1]))
    addSnapshot(co, snap(3, [0, 0, 0, 0, 0, 0])) // nothing routed: not a step
    expect(co.steps).toBe(2)
    expect(Array.from(co.fired)).toEqual([2, 1, 1, 0, 2, 2])
    expect(jaccard(co, 0, 0, 1)).toBeCloseTo(1 / 2)
    expect(jaccard(co, 0, 1, 2)).toBe(0)
    expect(jaccard(co, 1, 1, 2)).toBe(1)
    expect(jaccard(co, 0, 0, 1)).toBe(jaccard(co, 0, 1, 0))
    expect(partners(co, 0, 0)).toEqual([
      { expert: 1, together: 1 },
      { expert: 2, together: 1 },
    ])
  })

  it('ignores a snapshot of another shape', () => {
    const co = emptyCoActivation(1, 3)
    addSnapshot(co, snap(1, [1, 1, 0, 0, 1, 1]))
    expect(co.steps).toBe(0)
  })
})

describe('profile', () => {
  const turn: Turn = {
    finished_at: 1,
    wall_seconds: 2,
    prompt_tokens: 10,
    completion_tokens: 20,
    forward_passes: 21,
    disk_seconds: 0.5,
    io_wait_seconds: 0.25,
    expert_matmul_seconds: 0.5,
    attention_seconds: 0.5,
    dense_mlp_seconds: 0,
    lm_head_seconds: 0.25,
    other_seconds: 0.5,
    tokens_per_second: 12,
  }

  it('splits the wall time by phase; the fractions add up to 1', () => {
    const s = phases(turn)
    expect(s.map((x) => x.label)).toEqual(['I/O wait', 'expert matmul', 'attention', 'dense MLP', 'LM head', 'other'])
    expect(s.reduce((a, x) => a + x.fraction, 0)).toBeCloseTo(1)
    expect(s.find((x) => x.key === 'attention_seconds')!.fraction).toBeCloseTo(0.25)
  })

  it('derives "other" when the server leaves it out', () => {
    const t = { ...turn } as any
    delete t.other_seconds
    expect(phases(t).find((x) => x.key === 'other_seconds')!.seconds).toBeCloseTo(0.5)
  })

  it('keeps the last 30 turns', () => {
    const turns = Array.from({ length: 45 }, (_, i) => ({ ...turn, finished_at: i }))
    const last = lastTurns(turns)
    expect(last.length).toBe(30)
    expect(last[0].finished_at).toBe(15)
  })

  it('sums speculation over turns: acceptance and tokens per step', () => {
    const s = speculation([
      { ...turn, completion_tokens: 20, draft_tokens: 12, accepted_tokens: 8 },
      { ...turn, completion_tokens: 10, draft_tokens: 4, accepted_tokens: 2 },
    ])
    expect(s).toMatchObject({ drafted: 16, accepted: 10 })
    expect(s.acceptance).toBeCloseTo(10 / 16)
    expect(s.tokensPerStep).toBeCloseTo(30 / 20)
    expect(formatAcceptance(s.acceptance)).toBe('62.5%')
  })

  it('shows "—" when nothing was drafted', () => {
    const s = speculation([turn, { ...turn, draft_tokens: 0, accepted_tokens: 0 }])
    expect(s).toMatchObject({ drafted: 0, accepted: 0, acceptance: null })
    expect(s.tokensPerStep).toBe(1)
    expect(formatAcceptance(s.acceptance)).toBe('—')
    expect(speculation([]).tokensPerStep).toBeNull()
  })
})

describe('brio', () => {
  it('reads entropy as confident, unsure, not sure', () => {
    expect(verdict(0.1)).toBe('confident')
    expect(verdict(0.5)).toBe('unsure')
    expect(verdict(0.95)).toBe('not sure')
  })

  it('normalises entropy to 0..1', () => {
    expect(normalisedEntropy([0.5, 0.5])).toBeCloseTo(1)
    expect(normalisedEntropy([1, 0, 0])).toBe(0)
  })

  it('takes one allowed answer per line, trimmed and distinct', () => {
    expect(parseOptions(' yes \n\nno\nyes\n maybe')).toEqual(['yes', 'no', 'maybe'])
  })
})

describe('typed decisions', () => {
  const d = (kind: 'noul' | 'choice' | 'score', instructions: string, lines = '', yes = '', no = '') =>
    ({ id: 'q', kind, instructions, lines, yes, no })

  it('builds noul questions with one-sided, two-sided and absent criteria', () => {
    expect(decisionQuestion(d('noul', 'Spam?'))).toEqual({ type: 'noul', instructions: 'Spam?' })
    expect(decisionQuestion(d('noul', '', '', 'ads'))).toEqual({ type: 'noul', criteria: { true: 'ads' } })
    expect(decisionQuestion(d('noul', 'Spam?', '', 'ads', 'mail'))).toEqual({
      type: 'noul', instructions: 'Spam?', criteria: { true: 'ads', false: 'mail' } })
    expect(typeof decisionQuestion(d('noul', ''))).toBe('string')
  })

  it('reads choice options (with descriptions) and score levels one per line', () => {
    expect(decisionQuestion(d('choice', 'Team?', 'billing: payments\ntech\n café '))).toEqual({
      type: 'choice', instructions: 'Team?', criteria: { billing: 'payments', tech: null, 'café': null } })
    expect(typeof decisionQuestion(d('choice', 'Team?', 'only'))).toBe('string')
    expect(decisionQuestion(d('score', '', 'low\nhigh'))).toEqual({ type: 'score', criteria: ['low', 'high'] })
    expect(typeof decisionQuestion(d('score', '', Array.from({ length: 11 }, (_, i) => `l${i}`).join('\n')))).toBe('string')
  })

  it('turns answers into bars', () => {
    expect(answerBars({ type: 'noul', noul: 0.75 })).toEqual([['yes', 0.75], ['no', 0.25]])
    expect(answerBars({ type: 'choice', choice: 'b', confidence: 0.4, probabilities: { a: 0.3, b: 0.7 } })[0]).toEqual(['b', 0.7])
    expect(answerBars({ type: 'score', score: 0.6, confidence: 0.2, legend: { 0: 'low', 1: 'high' },
      probabilities: { 0: 0.4, 1: 0.6 } })).toEqual([['0 · low', 0.4], ['1 · high', 0.6]])
  })
})

describe('export and formatting', () => {
  const msgs = [
    { role: 'user' as const, content: 'Hi' },
    { role: 'assistant' as const, content: 'Hello!', reasoning: 'greet back' },
  ]
  const when = new Date('2026-01-02T03:04:05Z')

  it('exports Markdown with the reasoning folded', () => {
    const md = toMarkdown('m', msgs, when)
    expect(md).toContain('# Conversation with m')
    expect(md).toContain('## You\n\nHi')
    expect(md).toContain('<details><summary>Reasoning</summary>\n\ngreet back')
    expect(md).toContain('## Assistant')
  })

  it('exports JSON that reads back', () => {
    const back = JSON.parse(toJSON('m', msgs, when))
    expect(back.model).toBe('m')
    expect(back.exported_at).toBe('2026-01-02T03:04:05.000Z')
    expect(back.messages).toEqual(msgs)
  })

  it('formats bytes', () => {
    expect(formatBytes(0)).toBe('0 B')
    expect(formatBytes(1536)).toBe('1.5 KiB')
    expect(formatBytes(14155776)).toBe('14 MiB')
    expect(formatBytes(undefined)).toBe('–')
  })

  it('reads tier bytes from /health and from a stats frame', () => {
    expect(tierBytes({ dense_bytes: 1, experts_pinned_bytes: 2, experts_ram_bytes: 3, experts_disk_bytes: 4 })).toEqual({
      dense: 1,
      pinned: 2,
      ram: 3,
      disk: 4,
    })
    expect(tierBytes({ dense: 5, pinned: 0, cached: 7, disk: 9 })).toEqual({ dense: 5, pinned: 0, ram: 7, disk: 9 })
    expect(tierBytes(null)).toBeNull()
  })
})
