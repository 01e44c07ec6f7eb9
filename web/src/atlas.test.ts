import { describe, expect, it } from 'vitest'
import { checkAtlas, expertKey, layoutRegions, parseExpertKey, searchAtlas, showToken } from './atlas'
import type { Atlas, AtlasExpert, AtlasRegion } from './atlas'
import { parseHash, toHash } from './route'

function expert(e: number, region: string, tokens: [string, number, number][]): AtlasExpert {
  return {
    expert: e,
    region,
    count: 10,
    frequency: 0.1,
    gate_mean: 0.5,
    top_tokens: tokens.map(([token, count, share], id) => ({ id, token, count, share })),
    examples: [],
    categories: [],
    co_activation: [],
    next_layer: [],
  }
}

function region(id: string, experts: [number, number][], x: number, y: number): AtlasRegion {
  return { id, index: 0, name: id, description: '', experts, layers: {}, count: 1, top_tokens: [], categories: [], x, y }
}

const atlas: Atlas = {
  format: 'coli-atlas',
  version: 1,
  created: '',
  model: { fingerprint: 'f', model_type: 'm', moe_layer_count: 2, experts_per_layer: 2, top_k: 1, moe_layers: [0, 1] },
  corpus: { name: 'c', passages: 1, tokens: 1, categories: {} },
  regions: [region('code', [[0, 0], [1, 1]], 0.2, 0.5), region('words', [[0, 1], [1, 0]], 0.8, 0.5)],
  layers: [
    { layer: 0, decoder_layer: 0, experts: [expert(0, 'code', [[' return', 5, 0.9], ['def', 3, 0.4]]), expert(1, 'words', [[' the', 9, 0.3]])] },
    { layer: 1, decoder_layer: 1, experts: [expert(0, 'words', [['Return', 2, 0.2], [' returns', 4, 0.6]]), expert(1, 'code', [['return', 1, 0.5]])] },
  ],
}

describe('atlas', () => {
  it('checks the format and version', () => {
    expect(checkAtlas(atlas)).toBe(atlas)
    expect(checkAtlas({ format: 'x' })).toMatch(/not an expert atlas/)
    expect(checkAtlas({ ...atlas, version: 2 })).toMatch(/version 2/)
    expect(checkAtlas(null)).toMatch(/not an expert atlas/)
  })

  it('finds the experts that fire for a word, whole tokens and the most specific first', () => {
    const hits = searchAtlas(atlas, 'Return ')
    expect(hits.map((h) => expertKey(h.layer, h.expert))).toEqual(['L0E0', 'L1E1', 'L1E0'])
    expect(hits[0]).toMatchObject({ region: 'code', token: ' return', count: 5, exact: true })
    // a prefix matches too, after whole tokens
    expect(searchAtlas(atlas, 'retu').every((h) => !h.exact)).toBe(true)
    expect(searchAtlas(atlas, 'the').map((h) => expertKey(h.layer, h.expert))).toEqual(['L0E1'])
    expect(searchAtlas(atlas, '  ')).toEqual([])
    expect(searchAtlas(atlas, 'zebra')).toEqual([])
  })

  it('lays regions out without overlaps, inside the map', () => {
    const many = Array.from({ length: 10 }, (_, i) => region(`r${i}`, [[0, i]], 0.5, 0.5)) // all at one spot
    const blobs = layoutRegions(many, 600, 400)
    for (const b of blobs) {
      expect(b.x - b.r).toBeGreaterThanOrEqual(0)
      expect(b.y + b.r).toBeLessThanOrEqual(400)
      expect(Math.hypot((b.x - 300) / (300 - 4 - b.r), (b.y - 200) / (200 - 4 - b.r))).toBeLessThanOrEqual(1.0001) // in the ellipse
    }
    let overlaps = 0
    for (let i = 0; i < blobs.length; i++)
      for (let j = i + 1; j < blobs.length; j++)
        if (Math.hypot(blobs[i].x - blobs[j].x, blobs[i].y - blobs[j].y) < blobs[i].r + blobs[j].r) overlaps++
    expect(overlaps).toBe(0)
    const two = layoutRegions(atlas.regions, 600, 400)
    expect(two[0].x).toBeLessThan(two[1].x) // the atlas's positions are kept when there is room
    expect(layoutRegions(atlas.regions, 600, 400)).toEqual(two) // deterministic
  })

  it('names experts in addresses', () => {
    expect(parseExpertKey(expertKey(3, 17))).toEqual([3, 17])
    expect(parseExpertKey('L3')).toBeNull()
    expect(parseExpertKey(undefined)).toBeNull()
    expect(parseHash('#brain/explore/code-words/L0E1')).toEqual(['brain', 'explore', 'code-words', 'L0E1'])
    expect(parseHash(toHash(['brain', 'explore', 'a b/c']))).toEqual(['brain', 'explore', 'a b/c'])
    expect(parseHash('')).toEqual([])
    expect(showToken(' the')).toBe('·the')
    expect(showToken('\n')).toBe('⏎')
  })
})
