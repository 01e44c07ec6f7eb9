import { useEffect, useMemo, useRef, useState } from 'react'
import type { KeyboardEvent, WheelEvent } from 'react'
import { useStore } from '../store'
import { brightness, heatMinCount, jaccard, partners, TIER_NAMES, tierCounts } from '../transforms'
import type { CoActivation, ExpertGrid } from '../transforms'
import type { Activity } from '../store'
import { parseExpertKey } from '../atlas'
import { useRoute } from '../route'
import { AtlasExplore, NoAtlas, useAtlas } from './Atlas'

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

function Live({ g, selected }: { g: ExpertGrid; selected: number | null }) {
  const { co } = useStore()
  const [focus, setFocus] = useState<number | null>(null)
  const counts = tierCounts(g)
  const flash = g.seq % 2 ? 'flash-a' : 'flash-b'
  const shown = focus ?? selected // hovered, else the expert the address names (from Explore)
  const info = shown !== null && shown < g.rows * g.cols ? cellInfo(g, co, shown) : null

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
  const labelEvery = Math.max(1, Math.ceil(g.rows / 40))
  for (let i = 0; i < g.rows * g.cols; i++) {
    const routed = g.routed[i] === 1
    if (i % g.cols === 0) {
      const layer = i / g.cols
      cells.push(
        <span key={`l${layer}`} className="row-label" aria-hidden="true">
          {layer % labelEvery === 0 ? `L${layer}` : ''}
        </span>,
      )
    }
    cells.push(
      <span
        key={i}
        data-i={i}
        data-testid="expert-cell"
        data-tier={TIER_NAMES[g.tier[i]]}
        data-routed={routed ? 1 : 0}
        className={`cell ${TIER_CLASS[g.tier[i]]}${routed ? ` routed ${flash}` : ''}${focus === i ? ' focused' : ''}${selected === i ? ' selected' : ''}`}
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
        role="group"
        aria-label={`Expert grid: ${g.rows} layers by ${g.cols} experts. Arrow keys move between experts.`}
        onKeyDown={onKey}
        onMouseLeave={() => setFocus(null)}
        onMouseOver={(e) => {
          const i = (e.target as HTMLElement).dataset?.i
          if (i !== undefined) setFocus(Number(i))
        }}
        data-testid="expert-grid"
      >
        <div className="expert-grid" style={{ gridTemplateColumns: `max-content repeat(${g.cols}, minmax(6px, 30px))` }}>
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


/** Which experts each recent prompt used: one small grid per prompt, brightness = share of samples. */
function PromptAtlas({ activities, g }: { activities: Activity[]; g: ExpertGrid }) {
  const shown = activities.filter((a) => a.counts && a.samples > 0 && a.rows === g.rows && a.cols === g.cols).slice().reverse()
  if (!shown.length) return null
  return (
    <div className="prompt-atlas" data-testid="prompt-atlas">
      <h2>Experts by prompt</h2>
      <p className="hint">
        The experts routed while each recent prompt ran (layers top to bottom, experts left to right; brighter = routed
        in more of the sampled steps).
      </p>
      {shown.map((a, k) => {
        const top = topExperts(a, 3)
        return (
          <div className="prompt-row" key={k} data-testid="prompt-row">
            <div
              className="mini-grid"
              style={{ gridTemplateColumns: `repeat(${a.cols}, minmax(3px, 8px))` }}
              role="img"
              aria-label={`experts used by: ${a.label}`}
            >
              {Array.from(a.counts!, (c, i) => (
                <span
                  key={i}
                  className={c > 0 ? 'on' : ''}
                  style={c > 0 ? { opacity: 0.25 + (0.75 * c) / a.samples } : undefined}
                  title={`layer ${Math.floor(i / a.cols)} · expert ${i % a.cols}: ${c} of ${a.samples} samples`}
                />
              ))}
            </div>
            <div className="prompt-text">
              <b>{a.label.length > 90 ? a.label.slice(0, 90) + '…' : a.label}</b>
              <span className="hint">
                {a.samples} sample{a.samples === 1 ? '' : 's'} · most used: {top.map((t) => `L${t.layer}#${t.expert}`).join(', ')}
              </span>
            </div>
          </div>
        )
      })}
    </div>
  )
}

function topExperts(a: Activity, k: number) {
  const idx = Array.from(a.counts!.keys()).filter((i) => a.counts![i] > 0)
  idx.sort((x, y) => a.counts![y] - a.counts![x] || x - y)
  return idx.slice(0, k).map((i) => ({ layer: Math.floor(i / a.cols), expert: i % a.cols }))
}

const AXIS = 22

/** The co-activation matrix on a canvas (a 256-expert layer is 65,536 cells). */
function AtlasCanvas(props: {
  n: number
  cell: number
  values: number[]
  max: number
  hover: [number, number] | null
  onHover: (h: [number, number] | null) => void
  label: string
}) {
  const { n, cell, values, max, hover, onHover, label } = props
  const ref = useRef<HTMLCanvasElement>(null)
  const size = AXIS + n * cell
  useEffect(() => {
    const c = ref.current
    const ctx = c?.getContext('2d')
    if (!c || !ctx) return
    const dpr = window.devicePixelRatio || 1
    c.width = Math.round(size * dpr)
    c.height = Math.round(size * dpr)
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0)
    const css = getComputedStyle(c)
    const accent = css.getPropertyValue('--accent').trim() || '#16875a'
    const border = css.getPropertyValue('--border').trim() || '#ccc'
    const muted = css.getPropertyValue('--muted').trim() || '#888'
    ctx.clearRect(0, 0, size, size)
    const gap = cell >= 6 ? 1 : 0
    for (let a = 0; a < n; a++)
      for (let b = 0; b < n; b++) {
        const v = values[a * n + b]
        ctx.globalAlpha = a === b ? 1 : max ? 0.06 + 0.94 * (v / max) : 0.06
        ctx.fillStyle = a === b ? border : accent
        ctx.fillRect(AXIS + b * cell, AXIS + a * cell, cell - gap, cell - gap)
      }
    ctx.globalAlpha = 1
    ctx.fillStyle = muted
    ctx.font = '9px system-ui, sans-serif'
    const every = Math.max(1, Math.ceil(14 / cell))
    for (let i = 0; i < n; i += every) {
      ctx.textAlign = 'right'
      ctx.fillText(String(i), AXIS - 3, AXIS + i * cell + cell / 2 + 3)
      ctx.textAlign = 'center'
      ctx.fillText(String(i), AXIS + i * cell + cell / 2, AXIS - 6)
    }
    if (hover) {
      ctx.strokeStyle = css.getPropertyValue('--focus').trim() || '#2f6fde'
      ctx.lineWidth = 1.5
      ctx.strokeRect(AXIS + hover[1] * cell, AXIS + hover[0] * cell, cell - gap, cell - gap)
    }
  }, [n, cell, values, max, hover, size])
  return (
    <canvas
      ref={ref}
      style={{ width: size, height: size }}
      role="img"
      aria-label={label}
      data-testid="atlas-canvas"
      data-n={n}
      onMouseLeave={() => onHover(null)}
      onMouseMove={(e) => {
        const r = e.currentTarget.getBoundingClientRect()
        const b = Math.floor((e.clientX - r.left - AXIS) / cell)
        const a = Math.floor((e.clientY - r.top - AXIS) / cell)
        if (a >= 0 && b >= 0 && a < n && b < n) {
          if (!hover || hover[0] !== a || hover[1] !== b) onHover([a, b])
        } else if (hover) onHover(null)
      }}
    />
  )
}

function CoActivation({ g }: { g: ExpertGrid }) {
  const { co, coVersion, resetHistory, activities } = useStore()
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
      <h2>Co-activation in this session</h2>
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
          <AtlasCanvas
            n={n}
            cell={cell * zoom}
            values={matrix.m}
            max={matrix.max}
            hover={hover}
            onHover={setHover}
            label={`Co-activation of the ${n} experts of layer ${L}`}
          />
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
      <PromptAtlas activities={activities} g={g} />
    </div>
  )
}

function Explore({ g, route, go }: { g: ExpertGrid; route: string[]; go: (p: string[]) => void }) {
  const load = useAtlas(true)
  return (
    <>
      {load.state === 'loading' && <p className="hint">Loading the expert atlas…</p>}
      {load.state === 'none' && <NoAtlas message={load.message} />}
      {load.state === 'error' && <p className="notice">The expert atlas could not be read: {load.message}</p>}
      {load.state === 'ok' && <AtlasExplore atlas={load.atlas} region={route[2]} sel={parseExpertKey(route[3])} go={go} />}
      <CoActivation g={g} />
    </>
  )
}

export function Brain() {
  const { grid, coli } = useStore()
  const [route, go] = useRoute() // #brain/live[/L3E17] · #brain/explore[/<region>[/L3E17]]
  const view: 'live' | 'explore' = route[0] === 'brain' && route[1] === 'explore' ? 'explore' : 'live'
  const setView = (v: 'live' | 'explore') => go(['brain', v])
  const sel = route[1] === 'live' ? parseExpertKey(route[2]) : null
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
        <Live g={grid} selected={sel && sel[0] < grid.rows && sel[1] < grid.cols ? sel[0] * grid.cols + sel[1] : null} />
      ) : (
        <Explore g={grid} route={route} go={go} />
      )}
    </section>
  )
}
