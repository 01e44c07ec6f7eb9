// The expert atlas (GET /experts/atlas, made by `coli atlas`; format in docs/ATLAS.md):
// its shapes and the pure functions Brain → Explore draws with.

export interface AtlasToken {
  id: number
  token: string
  count: number
  share?: number // of the token's routings in that layer, the part that went to this expert
  lift?: number
}

export interface AtlasCategory {
  category: string
  share: number
  lift: number
}

export interface AtlasExample {
  left: string
  token: string
  right: string
  category: string | null
  gate: number
}

export interface AtlasPartner {
  expert: number
  count: number
  lift: number
}

export interface AtlasExpert {
  expert: number
  region: string | null
  count: number
  frequency: number
  gate_mean: number
  top_tokens: AtlasToken[]
  examples: AtlasExample[]
  categories: AtlasCategory[]
  co_activation: AtlasPartner[]
  next_layer: AtlasPartner[]
}

export interface AtlasRegion {
  id: string
  index: number
  name: string
  description: string
  experts: [number, number][] // [layer, expert]
  layers: Record<string, number>
  count: number
  top_tokens: AtlasToken[]
  categories: AtlasCategory[]
  x: number
  y: number
}

export interface Atlas {
  format: 'coli-atlas'
  version: number
  created: string
  model: { fingerprint: string; model_type: string; moe_layer_count: number; experts_per_layer: number; top_k: number; moe_layers: number[] }
  corpus: { name: string; passages: number; tokens: number; categories: Record<string, number> }
  regions: AtlasRegion[]
  layers: { layer: number; decoder_layer: number; experts: AtlasExpert[] }[]
}

export const ATLAS_VERSION = 1

/** A fetched document -> an Atlas, or an error message saying what is wrong with it. */
export function checkAtlas(doc: unknown): Atlas | string {
  const d = doc as Partial<Atlas> | null
  if (!d || typeof d !== 'object' || d.format !== 'coli-atlas') return 'not an expert atlas (format coli-atlas)'
  if (d.version !== ATLAS_VERSION) return `atlas version ${d.version}; this dashboard reads version ${ATLAS_VERSION}`
  if (!Array.isArray(d.regions) || !Array.isArray(d.layers) || !d.model) return 'the atlas has no regions or layers'
  return d as Atlas
}

/** "L3E17" <-> [3, 17]: an expert in a URL. */
export function expertKey(layer: number, expert: number): string {
  return `L${layer}E${expert}`
}

export function parseExpertKey(s: string | undefined): [number, number] | null {
  const m = /^L(\d+)E(\d+)$/.exec(s ?? '')
  return m ? [Number(m[1]), Number(m[2])] : null
}

export function expertOf(a: Atlas, layer: number, expert: number): AtlasExpert | null {
  return a.layers[layer]?.experts[expert] ?? null
}

export interface SearchHit {
  layer: number
  expert: number
  region: string | null
  token: string
  count: number
  share: number
  exact: boolean
}

function norm(s: string): string {
  return s.trim().toLowerCase()
}

/** Which experts fire for this word: experts whose top tokens match it (whole token first,
 *  then tokens that start with it), most specific first (share of the token's routings). */
export function searchAtlas(a: Atlas, query: string, limit = 24): SearchHit[] {
  const q = norm(query)
  if (!q) return []
  const hits: SearchHit[] = []
  for (const layer of a.layers) {
    for (const e of layer.experts) {
      let best: SearchHit | null = null
      for (const t of e.top_tokens) {
        const w = norm(t.token)
        if (!w) continue
        const exact = w === q
        if (!exact && !(q.length >= 2 && (w.startsWith(q) || (q.startsWith(w) && w.length >= 3)))) continue
        const hit = { layer: layer.layer, expert: e.expert, region: e.region, token: t.token, count: t.count, share: t.share ?? 0, exact }
        if (!best || rank(hit) > rank(best)) best = hit
      }
      if (best) hits.push(best)
    }
  }
  hits.sort((x, y) => rank(y) - rank(x) || x.layer - y.layer || x.expert - y.expert)
  return hits.slice(0, limit)
}

function rank(h: SearchHit): number {
  return (h.exact ? 2 : 1) * (h.share + 1e-3 * Math.log1p(h.count))
}

export interface Blob {
  id: string
  x: number
  y: number
  r: number
}

/** Region circles on a w x h map: area by expert count, placed at the atlas's (x, y),
 *  pushed apart until they do not overlap and kept inside the map's ellipse (relaxation
 *  rounds, deterministic). */
export function layoutRegions(regions: AtlasRegion[], w: number, h: number): Blob[] {
  const total = regions.reduce((s, r) => s + Math.max(1, r.experts.length), 0) || 1
  const area = 0.36 * w * h // the part of the map the regions cover (the ellipse is 0.785)
  const blobs = regions.map((r) => ({
    id: r.id,
    x: r.x * w,
    y: r.y * h,
    r: Math.max(18, Math.sqrt((area * Math.max(1, r.experts.length)) / total / Math.PI)),
  }))
  for (let round = 0; round < 200; round++) {
    let moved = false
    for (let i = 0; i < blobs.length; i++)
      for (let j = i + 1; j < blobs.length; j++) {
        const a = blobs[i]
        const b = blobs[j]
        let dx = b.x - a.x
        let dy = b.y - a.y
        let d = Math.hypot(dx, dy)
        const need = a.r + b.r + 4
        if (d >= need) continue
        if (d < 1e-6) {
          dx = Math.cos(i + j)
          dy = Math.sin(i + j)
          d = 1
        }
        const push = (need - d) / 2
        a.x -= (dx / d) * push
        a.y -= (dy / d) * push
        b.x += (dx / d) * push
        b.y += (dy / d) * push
        moved = true
      }
    for (const b of blobs) {
      // inside the map's ellipse (the "cortex"), each circle whole
      const ra = Math.max(1, w / 2 - 4 - b.r)
      const rb = Math.max(1, h / 2 - 4 - b.r)
      const u = (b.x - w / 2) / ra
      const v = (b.y - h / 2) / rb
      const d = Math.hypot(u, v)
      if (d > 1) {
        b.x = w / 2 + (u / d) * ra
        b.y = h / 2 + (v / d) * rb
        moved = true
      }
    }
    if (!moved) break
  }
  return blobs
}

/** The map's colour of region i (evenly spaced hues). */
export function regionHue(i: number, n: number): number {
  return Math.round((360 * i) / Math.max(1, n) + 150) % 360
}

/** Show a token's whitespace: leading space as ·, newline as ⏎. */
export function showToken(t: string): string {
  return t.replace(/\n/g, '⏎').replace(/^ /, '·') || '∅'
}
