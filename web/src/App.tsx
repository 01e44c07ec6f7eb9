import { useEffect, useState } from 'react'
import { useStore } from './store'
import { Chat } from './pages/Chat'
import { Brio } from './pages/Brio'
import { Brain } from './pages/Brain'
import { Profiling } from './pages/Profiling'
import { Icon } from './icons'
import { useRoute } from './route'

const PAGES = [
  { id: 'chat', label: 'Chat' },
  { id: 'brio', label: 'Brio' },
  { id: 'brain', label: 'Brain' },
  { id: 'profiling', label: 'Profiling' },
] as const
type PageId = (typeof PAGES)[number]['id']

type Theme = 'light' | 'dark'

function initialTheme(): Theme {
  try {
    const saved = localStorage.getItem('coli.theme')
    if (saved === 'light' || saved === 'dark') return saved
  } catch {
    /* private mode */
  }
  return window.matchMedia?.('(prefers-color-scheme: dark)').matches ? 'dark' : 'light'
}

function pageOf(route: string[]): PageId | null {
  return (PAGES.find((p) => p.id === route[0])?.id ?? null) as PageId | null
}

function SettingsDialog({ onClose }: { onClose: () => void }) {
  const { settings, setSettings, models, needKey, setNeedKey } = useStore()
  const [draft, setDraft] = useState(settings)
  return (
    <div className="modal-backdrop" role="presentation" onMouseDown={(e) => e.target === e.currentTarget && onClose()}>
      <form
        className="modal"
        role="dialog"
        aria-modal="true"
        aria-labelledby="settings-title"
        data-testid="settings"
        onKeyDown={(e) => e.key === 'Escape' && onClose()}
        onSubmit={(e) => {
          e.preventDefault()
          setNeedKey(false)
          setSettings(draft)
          onClose()
        }}
      >
        <h2 id="settings-title">{needKey ? 'This server needs an API key' : 'Connection'}</h2>
        {needKey && <p className="notice">The server answered 401: enter the key it was started with (--api-key or COLI_API_KEY).</p>}
        <label className="block">
          <span>API key</span>
          <input
            data-testid="api-key"
            type="password"
            autoComplete="off"
            autoFocus
            value={draft.apiKey}
            onChange={(e) => setDraft({ ...draft, apiKey: e.target.value })}
            placeholder="sent as Authorization: Bearer …"
          />
        </label>
        <label className="block">
          <span>Endpoint (empty: this server)</span>
          <input
            value={draft.baseUrl}
            onChange={(e) => setDraft({ ...draft, baseUrl: e.target.value })}
            placeholder="https://api.example.com"
          />
        </label>
        <label className="block">
          <span>Model (empty: the server's first)</span>
          <input list="models" value={draft.model} onChange={(e) => setDraft({ ...draft, model: e.target.value })} placeholder={models[0] ?? ''} />
          <datalist id="models">
            {models.map((m) => (
              <option key={m} value={m} />
            ))}
          </datalist>
        </label>
        <p className="hint">Stored in this browser only (localStorage).</p>
        <div className="row">
          <button type="button" onClick={onClose}>
            Cancel
          </button>
          <button type="submit" className="primary" data-testid="settings-save">
            Save
          </button>
        </div>
      </form>
    </div>
  )
}

export function App() {
  const store = useStore()
  const [route, go] = useRoute() // '#page[/view/...]': a view can be linked and reloaded
  const page: PageId = pageOf(route) ?? 'chat'
  const setPage = (p: PageId) => go([p])
  const [theme, setTheme] = useState<Theme>(initialTheme)
  const [showSettings, setShowSettings] = useState(false)

  useEffect(() => {
    document.documentElement.dataset.theme = theme
    try {
      localStorage.setItem('coli.theme', theme)
    } catch {
      /* private mode */
    }
  }, [theme])

  useEffect(() => {
    if (!pageOf(route)) go(['chat'], true)
  }, [route, go])

  useEffect(() => {
    if (store.needKey) setShowSettings(true)
  }, [store.needKey])

  const h = store.health
  return (
    <div className="app">
      <header className="topbar">
        <span className="brand">
          <span className="logo" aria-hidden="true" />
          colibri
        </span>
        <span className="model" data-testid="model" title="model">
          {store.model || '…'}
        </span>
        {!store.reachable && (
          <span className="status offline" role="status" data-testid="offline">
            <i className="bad" /> cannot reach the server
          </span>
        )}
        {store.reachable && store.coli && h && (
          <span className="status" data-testid="status">
            <i className={h.status === 'ok' ? 'ok' : 'bad'} /> {h.active ?? 0} active · {h.queued ?? 0} queued
          </span>
        )}
        <span className="spacer" />
        <button type="button" data-testid="settings-open" onClick={() => setShowSettings(true)} aria-label="Connection settings">
          <Icon name={store.settings.apiKey ? 'key' : 'gear'} />
          <span className="label">Settings</span>
        </button>
        <button
          type="button"
          data-testid="theme"
          onClick={() => setTheme(theme === 'dark' ? 'light' : 'dark')}
          aria-label={`Switch to the ${theme === 'dark' ? 'light' : 'dark'} theme`}
        >
          <Icon name={theme === 'dark' ? 'sun' : 'moon'} />
          <span className="label">{theme === 'dark' ? 'Light' : 'Dark'}</span>
        </button>
      </header>
      <nav className="dock" aria-label="Pages">
        {PAGES.map((p) => (
          <button
            key={p.id}
            type="button"
            data-testid={`dock-${p.id}`}
            aria-current={page === p.id ? 'page' : undefined}
            onClick={() => setPage(p.id)}
          >
            <Icon name={p.id} size={22} />
            <span>{p.label}</span>
          </button>
        ))}
      </nav>
      <main className="content">
        {/* every page stays mounted (a streaming answer survives a page switch) */}
        <div hidden={page !== 'chat'}>
          <Chat />
        </div>
        <div hidden={page !== 'brio'}>
          <Brio />
        </div>
        <div hidden={page !== 'brain'}>
          <Brain />
        </div>
        <div hidden={page !== 'profiling'}>
          <Profiling />
        </div>
      </main>
      {showSettings && <SettingsDialog onClose={() => setShowSettings(false)} />}
    </div>
  )
}
