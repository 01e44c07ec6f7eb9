// Brain → Explore: the measured expert atlas (GET /experts/atlas) as a map of regions to enter.
import { useEffect, useMemo, useState } from 'react'
import { ApiError, getJSON } from '../api'
import { checkAtlas, expertKey, expertOf, layoutRegions, regionHue, searchAtlas, showToken } from '../atlas'
import type { Atlas, AtlasExpert, AtlasRegion } from '../atlas'
import { useStore } from '../store'

type Load = { state: 'loading' } | { state: 'none'; message: string } | { state: 'error'; message: string } | { state: 'ok'; atlas: Atlas }

export function useAtlas(enabled: boolean): Load {
  const { settings, onError } = useStore()
  const [load, setLoad] = useState<Load>({ state: 'loading' })
  useEffect(() => {
    if (!enabled) return
    let cancelled = false
    getJSON<unknown>(settings, '/experts/atlas')
      .then((doc) => {
        if (cancelled) return
        const a = checkAtlas(doc)
        setLoad(typeof a === 'string' ? { state: 'error', message: a } : { state: 'ok', atlas: a })
      })
      .catch((e) => {
        if (cancelled) return
        if (e instanceof ApiError && e.status === 404) setLoad({ state: 'none', message: e.message })
        else setLoad({ state: 'error', message: onError(e) })
      })
    return () => {
      cancelled = true
    }
  }, [settings, enabled, onError])
  return load
}

const W = 720
const H = 420

function clip(s: string, n: number): string {
  return s.length > n ? s.slice(0, n - 1) + '…' : s
}

function Cortex({ atlas, onEnter }: { atlas: Atlas; onEnter: (id: string) => void }) {
  const blobs = useMemo(() => layoutRegions(atlas.regions, W, H), [atlas])
  const n = atlas.regions.length
  return (
    <svg className="cortex" viewBox={`0 0 ${W} ${H}`} role="img" aria-label={`The expert atlas: ${n} regions`} data-testid="cortex">
      <ellipse className="cortex-outline" cx={W / 2} cy={H / 2} rx={W / 2 - 4} ry={H / 2 - 4} />
      {blobs.map((b, i) => {
        const r = atlas.regions[i]
        const hue = regionHue(i, n)
        return (
          <g
            key={b.id}
            className="region-blob"
            data-testid="region-blob"
            data-region={r.id}
            role="link"
            tabIndex={0}
            aria-label={`${r.name}: ${r.experts.length} experts`}
            onClick={() => onEnter(r.id)}
            onKeyDown={(e) => (e.key === 'Enter' || e.key === ' ') && (e.preventDefault(), onEnter(r.id))}
          >
            <title>{`${r.name}: ${r.description}`}</title>
            <circle cx={b.x} cy={b.y} r={b.r} style={{ fill: `hsl(${hue} 60% 55% / 0.55)`, stroke: `hsl(${hue} 60% 40%)` }} />
            <text x={b.x} y={b.y - 2} textAnchor="middle">
              {clip(r.name, Math.max(6, Math.floor((2 * b.r + 24) / 7)))}
            </text>
            <text x={b.x} y={b.y + 12} textAnchor="middle" className="sub">
              {r.experts.length} expert{r.experts.length === 1 ? '' : 's'}
            </text>
          </g>
        )
      })}
    </svg>
  )
}

function Search({ atlas, go }: { atlas: Atlas; go: (parts: string[]) => void }) {
  const [q, setQ] = useState('')
  const hits = useMemo(() => searchAtlas(atlas, q), [atlas, q])
  const names = useMemo(() => Object.fromEntries(atlas.regions.map((r) => [r.id, r.name])), [atlas])
  return (
    <div className="atlas-search">
      <label className="field">
        <span>Which experts fire for</span>
        <input
          type="search"
          data-testid="atlas-search"
          value={q}
          placeholder="a word, e.g. return"
          onChange={(e) => setQ(e.target.value)}
          aria-label="Search the atlas for a word"
        />
      </label>
      {q.trim() && (
        <ul className="hits" data-testid="search-hits">
          {hits.length === 0 && <li className="hint">No expert has “{q.trim()}” among its top tokens.</li>}
          {hits.map((h) => (
            <li key={expertKey(h.layer, h.expert)}>
              <button
                type="button"
                className="link"
                data-testid="search-hit"
                onClick={() => go(['brain', 'explore', h.region ?? '-', expertKey(h.layer, h.expert)])}
              >
                layer {h.layer} · expert {h.expert}
              </button>{' '}
              <span className="hint">
                {showToken(h.token)} × {h.count}
                {h.share ? ` (${Math.round(h.share * 100)}% of its routings in the layer)` : ''} · {h.region ? names[h.region] : 'no region'}
              </span>
            </li>
          ))}
        </ul>
      )}
    </div>
  )
}

function Tokens({ e }: { e: { top_tokens: { token: string; count: number }[] } }) {
  return (
    <span className="tokens">
      {e.top_tokens.slice(0, 8).map((t, i) => (
        <code key={i} title={`${t.count} routings`}>
          {showToken(t.token)}
        </code>
      ))}
    </span>
  )
}

function ExpertDetail({ atlas, layer, e, go }: { atlas: Atlas; layer: number; e: AtlasExpert; go: (p: string[]) => void }) {
  return (
    <div className="expert-detail" data-testid="expert-detail">
      <h3>
        layer {layer} · expert {e.expert}
      </h3>
      <p className="hint">
        {(e.frequency * 100).toFixed(1)}% of tokens · mean gate {e.gate_mean.toFixed(2)} · {e.count} routings in the corpus
        {e.categories.length > 0 && ` · prefers ${e.categories.slice(0, 2).map((c) => `${c.category} (${c.lift.toFixed(1)}×)`).join(', ')}`}
      </p>
      <div>
        Top tokens: <Tokens e={e} />
      </div>
      {e.examples.length > 0 && (
        <ul className="examples" data-testid="examples">
          {e.examples.map((x, i) => (
            <li key={i}>
              <span className="ctx">{x.left}</span>
              <mark>{x.token}</mark>
              <span className="ctx">{x.right}</span>
              <span className="hint">
                {' '}
                {x.category ?? ''} · gate {x.gate.toFixed(2)}
              </span>
            </li>
          ))}
        </ul>
      )}
      <p className="hint">
        Fires with (this layer): {e.co_activation.map((p) => `#${p.expert}`).join(', ') || '–'}
        {e.next_layer.length > 0 && ` · then (layer ${layer + 1}): ${e.next_layer.map((p) => `#${p.expert}`).join(', ')}`}
      </p>
      <button type="button" data-testid="show-live" onClick={() => go(['brain', 'live', expertKey(layer, e.expert)])}>
        See it in Live routing
      </button>{' '}
      {atlas.regions.length > 0 && e.region && <span className="hint">region {atlas.regions.find((r) => r.id === e.region)?.name}</span>}
    </div>
  )
}

function RegionView({ atlas, region, sel, go }: { atlas: Atlas; region: AtlasRegion; sel: [number, number] | null; go: (p: string[]) => void }) {
  const cols = atlas.model.experts_per_layer
  const members = new Set(region.experts.map(([l, e]) => l * cols + e))
  const byLayer = new Map<number, number[]>()
  for (const [l, e] of region.experts) byLayer.set(l, [...(byLayer.get(l) ?? []), e])
  const selected = sel ? expertOf(atlas, sel[0], sel[1]) : null
  return (
    <div className="region-view" data-testid="region-view" data-region={region.id}>
      <nav className="crumbs">
        <button type="button" className="link" onClick={() => go(['brain', 'explore'])}>
          Atlas
        </button>{' '}
        / <b data-testid="region-name">{region.name}</b>
      </nav>
      <p>{region.description}</p>
      <div
        className="mini-grid region-grid"
        style={{ gridTemplateColumns: `repeat(${cols}, minmax(4px, 14px))` }}
        role="img"
        aria-label={`where the ${region.experts.length} experts of ${region.name} sit: layers top to bottom, experts left to right`}
      >
        {Array.from({ length: atlas.model.moe_layer_count * cols }, (_, i) => (
          <span key={i} className={members.has(i) ? 'on' : ''} title={`layer ${Math.floor(i / cols)} · expert ${i % cols}`} />
        ))}
      </div>
      <div className="region-layers">
        {[...byLayer.entries()].map(([l, es]) => (
          <div key={l} className="region-layer">
            <b>layer {l}</b>
            {es.map((e) => {
              const x = expertOf(atlas, l, e)
              const on = sel && sel[0] === l && sel[1] === e
              return (
                <button
                  key={e}
                  type="button"
                  className={`expert-chip${on ? ' on' : ''}`}
                  data-testid="region-expert"
                  aria-pressed={!!on}
                  onClick={() => go(['brain', 'explore', region.id, expertKey(l, e)])}
                >
                  #{e} {x && <Tokens e={{ top_tokens: x.top_tokens.slice(0, 3) }} />}
                </button>
              )
            })}
          </div>
        ))}
      </div>
      {selected && sel && <ExpertDetail atlas={atlas} layer={sel[0]} e={selected} go={go} />}
    </div>
  )
}

export function AtlasExplore({ atlas, region, sel, go }: { atlas: Atlas; region: string | undefined; sel: [number, number] | null; go: (p: string[]) => void }) {
  const reg = region ? atlas.regions.find((r) => r.id === region) : undefined
  // an expert reached by search may sit in no region ('-'): show it on its own
  const loose = sel && !reg ? expertOf(atlas, sel[0], sel[1]) : null
  return (
    <div className="atlas-explore" data-testid="atlas-explore">
      <p className="hint">
        {atlas.regions.length} regions over {atlas.model.moe_layer_count} MoE layers × {atlas.model.experts_per_layer} experts, measured on{' '}
        {atlas.corpus.passages} passages ({atlas.corpus.tokens.toLocaleString()} tokens) of the {atlas.corpus.name} corpus.
      </p>
      <Search atlas={atlas} go={go} />
      {reg ? (
        <RegionView atlas={atlas} region={reg} sel={sel} go={go} />
      ) : (
        <>
          {region && region !== '-' && <p className="notice">No region “{region}” in this atlas.</p>}
          {loose && sel && <ExpertDetail atlas={atlas} layer={sel[0]} e={loose} go={go} />}
          <Cortex atlas={atlas} onEnter={(id) => go(['brain', 'explore', id])} />
          <ul className="region-list">
            {atlas.regions.map((r, i) => (
              <li key={r.id}>
                <i style={{ background: `hsl(${regionHue(i, atlas.regions.length)} 60% 55%)` }} />
                <button type="button" className="link" data-testid="region-link" onClick={() => go(['brain', 'explore', r.id])}>
                  {r.name}
                </button>{' '}
                <span className="hint">{r.description}</span>
              </li>
            ))}
          </ul>
        </>
      )}
    </div>
  )
}

export function NoAtlas({ message }: { message: string }) {
  return (
    <div className="notice" data-testid="atlas-none">
      <p>
        <b>No expert atlas for this model yet.</b> The atlas says what each expert does: run a corpus through the model and
        group the experts into regions by what routes to them.
      </p>
      <p>
        Make one with <code>coli atlas --model &lt;model-dir&gt;</code> (a few minutes on a small model; it resumes if
        interrupted), then reload this page.
      </p>
      <p className="hint">{message}</p>
    </div>
  )
}
