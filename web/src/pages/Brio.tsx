import { useState } from 'react'
import { postJSON } from '../api'
import type { BrioResult } from '../api'
import { useStore } from '../store'
import { parseOptions, verdict } from '../transforms'
import { Decisions } from './Decisions'

const VERDICT_TEXT = {
  confident: 'Confident',
  unsure: 'Leaning, not certain',
  'not sure': 'Not sure — the model does not know which answer fits',
}

export function Brio() {
  const { settings, coli, model, onError, beginActivity, setGenerating } = useStore()
  const [doc, setDoc] = useState('The cat sat on the mat all afternoon, watching the birds outside.')
  const [question, setQuestion] = useState('Where did the cat sit?')
  const [optionsText, setOptionsText] = useState('on the mat\nin the garden\non the roof')
  const [result, setResult] = useState<BrioResult | null>(null)
  const [busy, setBusy] = useState(false)
  const [error, setError] = useState('')
  const options = parseOptions(optionsText)

  async function run() {
    setBusy(true)
    setError('')
    beginActivity(`Brio: ${question.trim() || doc.trim().slice(0, 60)}`)
    setGenerating(true)
    try {
      const body: Record<string, unknown> = { state: doc, options }
      if (question.trim()) body.question = question.trim()
      if (model) body.model = model
      const { data } = await postJSON<BrioResult>(settings, '/v1/brio', body)
      setResult(data)
    } catch (e) {
      setError(onError(e))
      setResult(null)
    } finally {
      setBusy(false)
      setGenerating(false)
    }
  }

  const v = result ? verdict(result.entropy) : null
  const sorted = result ? [...result.choices].sort((a, b) => b.p - a.p) : []
  return (
    <section className="page brio" aria-label="Brio">
      <p className="hint">
        Closed-set answers: the engine reads the probability of each allowed answer after the document and the
        question. Nothing is generated.
      </p>
      {!coli && <p className="notice">This endpoint is not a colibri server: /v1/brio is not available.</p>}
      <form
        className="brio-form"
        onSubmit={(e) => {
          e.preventDefault()
          run()
        }}
      >
        <label className="block">
          <span>Document</span>
          <textarea data-testid="brio-doc" rows={5} value={doc} onChange={(e) => setDoc(e.target.value)} />
        </label>
        <label className="block">
          <span>Question</span>
          <input data-testid="brio-question" value={question} onChange={(e) => setQuestion(e.target.value)} />
        </label>
        <label className="block">
          <span>Allowed answers (one per line, 2–64)</span>
          <textarea data-testid="brio-options" rows={4} value={optionsText} onChange={(e) => setOptionsText(e.target.value)} />
        </label>
        <button type="submit" className="primary" data-testid="brio-run" disabled={busy || !doc.trim() || options.length < 2 || options.length > 64}>
          {busy ? 'Reading…' : 'Score the answers'}
        </button>
      </form>
      {error && (
        <p className="error" role="alert">
          {error}
        </p>
      )}
      {result && v && (
        <div className={`brio-result verdict-${v.replace(' ', '-')}`} data-testid="brio-result" data-verdict={v}>
          <div className="verdict" role="status">
            <strong>{VERDICT_TEXT[v]}</strong>
            <span>
              entropy <b data-testid="brio-entropy">{result.entropy.toFixed(3)}</b> (0 certain · 1 no idea)
            </span>
          </div>
          <div className="entropy-meter" aria-hidden="true">
            <span style={{ width: `${Math.max(2, result.entropy * 100)}%` }} />
          </div>
          <ol className="choices">
            {sorted.map((c) => (
              <li key={c.option} data-testid="brio-choice" data-p={c.p} className={c.option === result.answer ? 'best' : ''}>
                <span className="opt">{c.option}</span>
                <span className="bar">
                  <span style={{ width: `${c.p * 100}%` }} />
                </span>
                <span className="p">{(c.p * 100).toFixed(1)}%</span>
                <span className="lp" title="mean log-probability per token · tokens">
                  {c.mean_logprob.toFixed(2)} · {c.tokens} tok
                </span>
              </li>
            ))}
          </ol>
        </div>
      )}
      <Decisions doc={doc} />
    </section>
  )
}
