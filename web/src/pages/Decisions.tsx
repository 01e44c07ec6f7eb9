import { useState } from 'react'
import { postJSON } from '../api'
import type { SystemOneResult } from '../api'
import { useStore } from '../store'
import { answerBars, decisionQuestion } from '../transforms'
import type { DecisionDraft, DecisionKind } from '../transforms'

const KINDS: { kind: DecisionKind; label: string }[] = [
  { kind: 'noul', label: 'Yes / no' },
  { kind: 'choice', label: 'Choice' },
  { kind: 'score', label: 'Score' },
]

let next = 1
function draft(kind: DecisionKind, instructions = '', lines = ''): DecisionDraft {
  return { id: `q${next++}`, kind, instructions, lines, yes: '', no: '' }
}

/** Typed decisions (POST /v1/systemone) about the Brio page's document: build questions,
 *  see each outcome's probability as a bar and the answer's confidence. */
export function Decisions({ doc }: { doc: string }) {
  const { settings, coli, model, onError, beginActivity, setGenerating } = useStore()
  const [drafts, setDrafts] = useState<DecisionDraft[]>(() => [
    draft('noul', 'Is the cat indoors?'),
    draft('choice', 'What is the cat doing?', 'watching birds\nsleeping\neating'),
    draft('score', 'How calm is the scene?', 'not calm\nsomewhat calm\nvery calm'),
  ])
  const [result, setResult] = useState<SystemOneResult | null>(null)
  const [busy, setBusy] = useState(false)
  const [error, setError] = useState('')
  const built = drafts.map(decisionQuestion)
  const problem = built.find((q) => typeof q === 'string') as string | undefined

  function update(id: string, patch: Partial<DecisionDraft>) {
    setDrafts((ds) => ds.map((d) => (d.id === id ? { ...d, ...patch } : d)))
  }

  async function run() {
    setBusy(true)
    setError('')
    beginActivity(`Decisions: ${drafts.length} question(s)`)
    setGenerating(true)
    try {
      const questions = Object.fromEntries(drafts.map((d, i) => [d.id, built[i]]))
      const body: Record<string, unknown> = { state: doc, questions }
      if (model) body.model = model
      const { data } = await postJSON<SystemOneResult>(settings, '/v1/systemone', body)
      setResult(data)
    } catch (e) {
      setError(onError(e))
      setResult(null)
    } finally {
      setBusy(false)
      setGenerating(false)
    }
  }

  return (
    <div className="decisions" data-testid="decisions">
      <h3>Typed decisions</h3>
      <p className="hint">
        Yes/no, choice and score questions about the document, each answered with probabilities in one batched pass
        (<code>POST /v1/systemone</code>). Confidence is 0 for a uniform answer and 1 for a certain one.
      </p>
      {!coli && <p className="notice">This endpoint is not a colibri server: /v1/systemone is not available.</p>}
      <form
        className="brio-form"
        onSubmit={(e) => {
          e.preventDefault()
          run()
        }}
      >
        {drafts.map((d) => (
          <fieldset key={d.id} className="decision" data-testid="decision-question">
            <div className="decision-head">
              <select value={d.kind} aria-label="question type" onChange={(e) => update(d.id, { kind: e.target.value as DecisionKind })}>
                {KINDS.map((k) => (
                  <option key={k.kind} value={k.kind}>
                    {k.label}
                  </option>
                ))}
              </select>
              <input
                aria-label="question"
                placeholder="The question"
                value={d.instructions}
                onChange={(e) => update(d.id, { instructions: e.target.value })}
              />
              <button type="button" aria-label="remove question" onClick={() => setDrafts((ds) => ds.filter((x) => x.id !== d.id))}>
                ×
              </button>
            </div>
            {d.kind === 'noul' ? (
              <div className="decision-sides">
                <input aria-label="yes means" placeholder="Yes means… (optional)" value={d.yes} onChange={(e) => update(d.id, { yes: e.target.value })} />
                <input aria-label="no means" placeholder="No means… (optional)" value={d.no} onChange={(e) => update(d.id, { no: e.target.value })} />
              </div>
            ) : (
              <textarea
                aria-label={d.kind === 'choice' ? 'options' : 'levels'}
                rows={3}
                placeholder={d.kind === 'choice' ? 'One option per line (name: description)' : 'One level per line, lowest first'}
                value={d.lines}
                onChange={(e) => update(d.id, { lines: e.target.value })}
              />
            )}
          </fieldset>
        ))}
        <div className="decision-actions">
          {KINDS.map((k) => (
            <button key={k.kind} type="button" onClick={() => setDrafts((ds) => [...ds, draft(k.kind)])}>
              + {k.label}
            </button>
          ))}
          <button type="submit" className="primary" data-testid="decisions-run" disabled={busy || !doc.trim() || !drafts.length || !!problem}>
            {busy ? 'Reading…' : 'Decide'}
          </button>
        </div>
        {problem && <p className="hint">{problem}</p>}
      </form>
      {error && (
        <p className="error" role="alert">
          {error}
        </p>
      )}
      {result &&
        drafts.map((d) => {
          const a = result.answers[d.id]
          if (!a) return null
          const headline =
            a.type === 'noul' ? `yes ${(a.noul * 100).toFixed(1)}%` : a.type === 'choice' ? a.choice : `score ${a.score.toFixed(2)}`
          return (
            <div key={d.id} className="brio-result" data-testid="decision-answer" data-type={a.type}>
              <div className="verdict" role="status">
                <strong>{d.instructions || d.kind}</strong>
                <span>
                  → <b>{headline}</b>
                  {a.type !== 'noul' && <> · confidence <b data-testid="decision-confidence">{a.confidence.toFixed(3)}</b></>}
                </span>
              </div>
              {a.type !== 'noul' && (
                <div className="entropy-meter confidence" aria-hidden="true">
                  <span style={{ width: `${Math.max(2, a.confidence * 100)}%` }} />
                </div>
              )}
              <ol className="choices">
                {answerBars(a).map(([label, p]) => (
                  <li key={label} data-p={p}>
                    <span className="opt">{label}</span>
                    <span className="bar">
                      <span style={{ width: `${p * 100}%` }} />
                    </span>
                    <span className="p">{(p * 100).toFixed(1)}%</span>
                  </li>
                ))}
              </ol>
            </div>
          )
        })}
    </div>
  )
}
