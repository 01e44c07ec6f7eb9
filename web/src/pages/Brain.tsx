import { useMemo, useState } from 'react'
import type { KeyboardEvent, WheelEvent } from 'react'
import { useStore } from '../store'
import { brightness, heatMinCount, jaccard, partners, TIER_NAMES, tierCounts } from '../transforms'
import type { CoActivation, ExpertGrid } from '../transforms'

const TIER_CLASS = ['t-disk', 't-ram', 't-pinned', 't-other']

function cellInfo(g: ExpertGrid, co: CoActivation | null, i: number) {
  const layer = Math.floor(i / g.cols)
  const expert = i % g.cols
  const heat = g.heat[i]
  const fired = co && co.rows === g.rows && co.cols === g.cols ? co.fired[i] : 0
  return {
    layer,
    expert,
    tier: TIER_NAMES[g.tier[i]],
    heat,
    count: heat ? `≥ ${heatMinCount(heat)} routings (heat ${heat})` : 'never routed',
    fired,
    routed: !!g.routed[i],
  }
}

function Live({ g }: { g: ExpertGrid }) {
  const { co } = useStore()
  const [focus, setFocus] = useState<number | null>(null)
  const counts = tierCounts(g)
  const flash = g.seq % 2 ? 'flash-a' : 'flash-b'
  const info = focus !== null && focus < g.rows * g.cols ? cellInfo(g, co, focus) : null

  function onKey(e: KeyboardEvent) {
    const n = g.rows * g.cols
    const cur = focus ?? 0
    const moves: Record<string, number> = { ArrowRight: 1, ArrowLeft: -1, ArrowDown: g.cols, ArrowUp: -g.cols }
    if (e.key in moves) {
      e.preventDefault()
      setFocus(Math.min(n - 1, Math.max(0, (focus === null ? 0 : cur + moves[e.key]))))
    } else if (e.key === 'Escape') setFocus(null)
  }

  const cells = []
  for (let i = 0; i < g.rows * g.cols; i++) {
    const routed = g.routed[i] === 1
    cells.push(
      <span
        key={i}
        data-i={i}
        data-testid="expert-cell"
        data-tier={TIER_NAMES[g.tier[i]]}
        data-routed={routed ? 1 : 0}
        className={`cell ${TIER_CLASS[g.tier[i]]}${routed ? ` routed ${flash}` : ''}${focus === i ? ' focused' : ''}`}
        style={{ opacity: brightness(g.heat[i], g.maxHeat) }}
      />,
    )
  }
  return (
    <div className="live">
      <div className="brain-summary">
        <span>
          {g.rows} MoE layers × {g.cols} experts
        </span>
        <span data-testid="routed-count">{g.routedCount} routed in step {g.seq}</span>
        <span className="tiers">
          <i className="t-ram" /> RAM {counts[1]} <i className="t-pinned" /> pinned {counts[2]} <i className="t-disk" /> disk {counts[0]}
        </span>
      </div>
      <div
        className="grid-wrap"
        tabIndex={0}
        role="grid"
        aria-label={`Expert grid: ${g.rows} layers by ${g.cols} experts. Arrow keys move between experts.`}
        onKeyDown={onKey}
        onMouseLeave={() => setFocus(null)}
        onMouseOver={(e) => {
          const i = (e.target as HTMLElement).dataset?.i
          if (i !== undefined) setFocus(Number(i))
        }}
        data-testid="expert-grid"
      >
        <div className="expert-grid" style={{ gridTemplateColumns: `repeat(${g.cols}, minmax(6px, 30px))` }}>
          {cells}
        </div>
      </div>
      <div className="cell-info" data-testid="cell-info" aria-live="polite">
        {info ? (
          <>
            <b>
              layer {info.layer} · expert {info.expert}
            </b>
            <span>tier {info.tier}</span>
            <span>{info.count}</span>
            <span>routed in {info.fired} sampled step{info.fired === 1 ? '' : 's'}</span>
            {info.routed && <span className="now">routed now</span>}
          </>
        ) : (
          <span className="hint">Hover an expert (or focus the grid and use the arrow keys) for its layer, index, tier and counts.</span>
        )}
      </div>
    </div>
  )
}

function Explore({ g }: { g: ExpertGrid }) {
  const { co, coVersion, resetHistory } = useStore()
  const [layer, setLayer] = useState(0)
  const [zoom, setZoom] = useState(1)
  const [hover, setHover] = useState<[number, number] | null>(null)
  const valid = co && co.rows === g.rows && co.cols === g.cols ? co : null
  const L = Math.min(layer, g.rows - 1)
  const n = g.cols
  const matrix = useMemo(() => {
    if (!valid) return null
    const m: number[] = []
    let max = 0
    for (let a = 0; a < n; a++)
      for (let b = 0; b < n; b++) {
        const v = a === b ? 0 : jaccard(valid, L, a, b)
        m.push(v)
        if (v > max) max = v
      }
    return { m, max }
    // coVersion: the history grows in place
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, [valid, L, n, coVersion])
  const cell = Math.max(4, Math.min(40, Math.floor(480 / Math.max(n, 1))))
  const size = n * cell
  function onWheel(e: WheelEvent) {
    if (!e.ctrlKey && !e.altKey) return
    e.preventDefault()
    setZoom((z) => Math.min(8, Math.max(0.5, z * (e.deltaY < 0 ? 1.2 : 1 / 1.2))))
  }
  const info =
    hover && valid
      ? {
          a: hover[0],
          b: hover[1],
          together: valid.pairs[(L * n + hover[0]) * n + hover[1]],
          j: jaccard(valid, L, hover[0], hover[1]),
          partners: partners(valid, L, hover[0]),
        }
      : null
  return (
    <div className="explore">
      <p className="hint">
        Which experts fire together. The server exposes only the latest step's routed experts, so this atlas is
        built here, in the browser, from every /experts snapshot seen since the page opened ({valid?.steps ?? 0}{' '}
        sampled steps). Colour = how often two experts of the layer were routed in the same step (Jaccard).
      </p>
      <div className="toolbar">
        <label className="field">
          <span>Layer</span>
          <select data-testid="explore-layer" value={L} onChange={(e) => setLayer(Number(e.target.value))}>
            {Array.from({ length: g.rows }, (_, i) => (
              <option key={i} value={i}>
                {i}
              </option>
            ))}
          </select>
        </label>
        <button type="button" aria-label="Zoom out" onClick={() => setZoom((z) => Math.max(0.5, z / 1.25))}>
          −
        </button>
        <span className="zoom">{Math.round(zoom * 100)}%</span>
        <button type="button" aria-label="Zoom in" onClick={() => setZoom((z) => Math.min(8, z * 1.25))}>
          +
        </button>
        <button type="button" onClick={resetHistory}>
          Reset history
        </button>
      </div>
      {!matrix || !valid?.steps ? (
        <p className="hint" data-testid="explore-empty">
          No routing seen yet: send a chat message and watch the map fill in.
        </p>
      ) : (
        <div className="atlas-wrap" onWheel={onWheel} data-testid="atlas">
          <svg
            width={size * zoom + 30 * zoom}
            height={size * zoom + 30 * zoom}
            viewBox={`-30 -30 ${size + 30} ${size + 30}`}
            role="img"
            aria-label={`Co-activation of the ${n} experts of layer ${L}`}
            onMouseLeave={() => setHover(null)}
          >
            {Array.from({ length: n }, (_, i) => (
              <g key={i} className="axis">
                {(n <= 32 || i % 8 === 0) && (
                  <>
                    <text x={-4} y={i * cell + cell / 2 + 3} textAnchor="end">
                      {i}
                    </text>
                    <text x={i * cell + cell / 2} y={-6} textAnchor="middle">
                      {i}
                    </text>
                  </>
                )}
              </g>
            ))}
            {matrix.m.map((v, k) => {
              const a = Math.floor(k / n)
              const b = k % n
              return (
                <rect
                  key={k}
                  x={b * cell}
                  y={a * cell}
                  width={cell - 1}
                  height={cell - 1}
                  className={a === b ? 'diag' : 'co'}
                  style={a === b ? undefined : { fillOpacity: matrix.max ? 0.06 + 0.94 * (v / matrix.max) : 0.06 }}
                  onMouseEnter={() => setHover([a, b])}
                />
              )
            })}
          </svg>
        </div>
      )}
      <div className="cell-info" aria-live="polite">
        {info ? (
          <>
            <b>
              layer {L}: expert {info.a} & expert {info.b}
            </b>
            <span>together in {info.together} step(s) · Jaccard {info.j.toFixed(2)}</span>
            <span>
              expert {info.a} fires most with: {info.partners.map((p) => `#${p.expert} (${p.together})`).join(', ') || '–'}
            </span>
          </>
        ) : (
          <span className="hint">Hover the map; Ctrl+wheel or the buttons zoom.</span>
        )}
      </div>
    </div>
  )
}

export function Brain() {
  const { grid, coli } = useStore()
  const [view, setView] = useState<'live' | 'explore'>('live')
  return (
    <section className="page brain" aria-label="Brain">
      <div className="tabs" role="tablist">
        <button type="button" role="tab" aria-selected={view === 'live'} onClick={() => setView('live')} data-testid="tab-live">
          Live routing
        </button>
        <button type="button" role="tab" aria-selected={view === 'explore'} onClick={() => setView('explore')} data-testid="tab-explore">
          Explore
        </button>
      </div>
      {!coli ? (
        <p className="notice">The Brain needs a colibri server (GET /experts).</p>
      ) : !grid ? (
        <p className="hint">Loading the expert grid…</p>
      ) : grid.rows === 0 ? (
        <p className="hint">This model has no MoE layers.</p>
      ) : view === 'live' ? (
        <Live g={grid} />
      ) : (
        <Explore g={grid} />
      )}
    </section>
  )
}
