import { useStore } from '../store'
import { formatAcceptance, formatBytes, formatSeconds, lastTurns, phases, PHASES, speculation, turnTokPerSec } from '../transforms'
import type { Turn } from '../api'

function TurnBars({ turn, scale }: { turn: Turn; scale: number }) {
  const slices = phases(turn)
  return (
    <div className="turn-bars">
      <div className="stack" role="img" aria-label={slices.map((s) => `${s.label} ${formatSeconds(s.seconds)}`).join(', ')}>
        {slices.map((s) =>
          s.seconds > 0 ? (
            <span
              key={s.key}
              data-testid="phase-bar"
              data-phase={s.key}
              style={{ width: `${(100 * s.seconds) / scale}%`, background: s.color }}
              title={`${s.label}: ${formatSeconds(s.seconds)} (${(100 * s.fraction).toFixed(0)}%)`}
            />
          ) : null,
        )}
      </div>
      <div className="disk" title="disk service: overlapped with compute, so shown apart">
        <span data-testid="disk-bar" style={{ width: `${(100 * (turn.disk_seconds || 0)) / scale}%` }} />
      </div>
    </div>
  )
}

export function Profiling() {
  const { profile, coli } = useStore()
  const turns = profile?.turns ?? []
  const recent = lastTurns(turns, 30)
  const latest = turns[turns.length - 1]
  const maxWall = Math.max(1e-9, ...recent.map((t) => t.wall_seconds))
  const maxTps = Math.max(1e-9, ...recent.map((t) => turnTokPerSec(t) ?? 0))
  const spec = speculation(recent)
  return (
    <section className="page profiling" aria-label="Profiling">
      {!coli && <p className="notice">Profiling needs a colibri server (GET /profile).</p>}
      <ul className="legend">
        {PHASES.map((p) => (
          <li key={p.key}>
            <i style={{ background: p.color }} /> {p.label}
          </li>
        ))}
        <li>
          <i className="disk-swatch" /> disk service (overlaps compute)
        </li>
      </ul>
      {!latest ? (
        <p className="hint" data-testid="profile-empty">
          No turns yet: send a chat message, then come back.
        </p>
      ) : (
        <>
          <h2>Last turn</h2>
          <div className="card" data-testid="last-turn">
            <TurnBars turn={latest} scale={latest.wall_seconds} />
            <dl className="facts">
              <div><dt>wall</dt><dd>{formatSeconds(latest.wall_seconds)}</dd></div>
              <div><dt>tokens</dt><dd>{latest.prompt_tokens} in · {latest.completion_tokens} out</dd></div>
              <div><dt>tok/s</dt><dd>{turnTokPerSec(latest)?.toFixed(1) ?? '–'}</dd></div>
              <div><dt>forward passes</dt><dd>{latest.forward_passes}</dd></div>
              <div><dt>disk service</dt><dd>{formatSeconds(latest.disk_seconds || 0)}</dd></div>
              {latest.bytes_read != null && <div><dt>read</dt><dd>{formatBytes(latest.bytes_read)}</dd></div>}
              {latest.experts_needed ? (
                <div><dt>expert hits</dt><dd>{((100 * (latest.experts_hit ?? 0)) / latest.experts_needed).toFixed(1)}%</dd></div>
              ) : null}
            </dl>
            <table className="phase-table">
              <tbody>
                {phases(latest).map((s) => (
                  <tr key={s.key}>
                    <th scope="row"><i style={{ background: s.color }} /> {s.label}</th>
                    <td>{formatSeconds(s.seconds)}</td>
                    <td>{(100 * s.fraction).toFixed(1)}%</td>
                  </tr>
                ))}
              </tbody>
            </table>
          </div>
          <h2>Last {recent.length} turn{recent.length === 1 ? '' : 's'}</h2>
          <dl className="facts" data-testid="speculation" title="speculative decoding over these turns">
            <div><dt>drafts accepted</dt><dd>{spec.accepted} / {spec.drafted}</dd></div>
            <div><dt>acceptance</dt><dd data-testid="acceptance">{formatAcceptance(spec.acceptance)}</dd></div>
            <div>
              <dt title="output tokens per step that yielded any: accepted drafts + 1">tokens/step</dt>
              <dd>{spec.tokensPerStep?.toFixed(2) ?? '—'}</dd>
            </div>
          </dl>
          <div className="card trend" data-testid="trend">
            {recent.map((t, i) => (
              <div className="trend-row" key={`${t.finished_at}-${i}`} data-testid="trend-row">
                <span className="idx">#{turns.length - recent.length + i + 1}</span>
                <TurnBars turn={t} scale={maxWall} />
                <span className="tps" title="decode tok/s">
                  <span style={{ width: `${(100 * (turnTokPerSec(t) ?? 0)) / maxTps}%` }} />
                  <em>{turnTokPerSec(t)?.toFixed(1) ?? '–'}</em>
                </span>
              </div>
            ))}
          </div>
        </>
      )}
    </section>
  )
}
