// App-wide state: settings, the server's identity, polled telemetry, routing history.
import { createContext, useCallback, useContext, useEffect, useRef, useState } from 'react'
import type { ReactNode } from 'react'
import { ApiError, getJSON } from './api'
import type { ExpertsSnapshot, Health, ProfileData, Settings } from './api'
import { addSnapshot, decodeExperts, emptyCoActivation } from './transforms'
import type { CoActivation, ExpertGrid } from './transforms'

const SETTINGS_KEY = 'coli.settings'

function loadSettings(): Settings {
  const fallback: Settings = { baseUrl: '', apiKey: '', model: '' }
  try {
    const raw = localStorage.getItem(SETTINGS_KEY)
    return raw ? { ...fallback, ...JSON.parse(raw) } : fallback
  } catch {
    return fallback
  }
}

export interface Store {
  settings: Settings
  setSettings: (s: Settings) => void
  needKey: boolean
  setNeedKey: (v: boolean) => void
  coli: boolean // the endpoint is a colibri server (has /experts, /profile, /v1/brio)
  models: string[]
  model: string
  health: Health | null
  reachable: boolean // the last /health or /v1/models call got an answer
  grid: ExpertGrid | null
  co: CoActivation | null
  coVersion: number
  resetHistory: () => void
  profile: ProfileData | null
  refreshProfile: () => void
  generating: boolean
  setGenerating: (v: boolean) => void
  beginActivity: (label: string) => void // a chat turn or a Brio question: its routing is kept apart
  activities: Activity[]
  onError: (e: unknown) => string // returns a message; flags a missing key
}

/** The experts routed (in the sampled /experts snapshots) while one prompt ran. */
export interface Activity {
  label: string
  samples: number
  counts: Float64Array | null // rows*cols
  rows: number
  cols: number
}

const MAX_ACTIVITIES = 12

const Ctx = createContext<Store | null>(null)

export function useStore(): Store {
  const s = useContext(Ctx)
  if (!s) throw new Error('useStore outside StoreProvider')
  return s
}

function usePoll(fn: () => Promise<void> | void, ms: number, enabled: boolean) {
  const ref = useRef(fn)
  ref.current = fn
  useEffect(() => {
    if (!enabled) return
    let stopped = false
    let timer: ReturnType<typeof setTimeout>
    const tick = async () => {
      if (stopped) return
      if (!document.hidden) {
        try {
          await ref.current()
        } catch {
          /* reported by the callee */
        }
      }
      if (!stopped) timer = setTimeout(tick, ms)
    }
    tick()
    return () => {
      stopped = true
      clearTimeout(timer)
    }
  }, [ms, enabled])
}

export function StoreProvider({ children }: { children: ReactNode }) {
  const [settings, setSettingsState] = useState<Settings>(loadSettings)
  const [needKey, setNeedKey] = useState(false)
  const [coli, setColi] = useState(false)
  const [models, setModels] = useState<string[]>([])
  const [health, setHealth] = useState<Health | null>(null)
  const [reachable, setReachable] = useState(true)
  const [grid, setGrid] = useState<ExpertGrid | null>(null)
  const [profile, setProfile] = useState<ProfileData | null>(null)
  const [generating, setGeneratingState] = useState(false)
  const activitiesRef = useRef<Activity[]>([])
  const [coVersion, setCoVersion] = useState(0)
  const coRef = useRef<CoActivation | null>(null)
  const lastSeq = useRef<number>(-1)
  const lastKey = useRef('')

  const setSettings = useCallback((s: Settings) => {
    setSettingsState(s)
    try {
      localStorage.setItem(SETTINGS_KEY, JSON.stringify(s))
    } catch {
      /* private mode */
    }
  }, [])

  const onError = useCallback((e: unknown): string => {
    if (e instanceof ApiError) {
      if (e.status === 401) setNeedKey(true)
      return e.message
    }
    if (e instanceof DOMException && e.name === 'AbortError') return 'stopped'
    return e instanceof Error ? e.message : String(e)
  }, [])

  // who is this: models, and whether colibri's own endpoints answer
  useEffect(() => {
    let cancelled = false
    ;(async () => {
      try {
        const m = await getJSON<{ data: { id: string; owned_by?: string }[] }>(settings, '/v1/models')
        if (cancelled) return
        setModels(m.data.map((d) => d.id))
        // colibri's own endpoints (/experts, /profile, /v1/brio) only where the models say so:
        // no probing of paths another OpenAI-compatible server does not have
        setColi(m.data.some((d) => d.owned_by === 'colibri'))
        setNeedKey(false)
        setReachable(true)
      } catch (e) {
        if (!cancelled) {
          setColi(false)
          setReachable(e instanceof ApiError)
          onError(e)
        }
      }
    })()
    return () => {
      cancelled = true
    }
  }, [settings, onError])

  const resetHistory = useCallback(() => {
    coRef.current = null
    activitiesRef.current = []
    lastSeq.current = -1
    setCoVersion((v) => v + 1)
  }, [])

  usePoll(
    async () => {
      try {
        setHealth(await getJSON<Health>(settings, '/health'))
        setReachable(true)
      } catch (e) {
        setReachable(e instanceof ApiError) // an HTTP answer, even an error, means it is there
        onError(e)
      }
    },
    generating ? 1000 : 3000,
    coli,
  )

  const pollExperts = useRef<() => Promise<void>>(async () => {})
  pollExperts.current = async () => {
      let snap: ExpertsSnapshot
      try {
        snap = await getJSON<ExpertsSnapshot>(settings, '/experts')
      } catch (e) {
        onError(e)
        return
      }
      const key = `${snap.seq}|${snap.cells}|${snap.routed}`
      if (key === lastKey.current) return // nothing changed: no re-render of a big grid
      lastKey.current = key
      const g = decodeExperts(snap)
      setGrid(g)
      if (g.seq !== lastSeq.current) {
        lastSeq.current = g.seq
        if (!coRef.current || coRef.current.rows !== g.rows || coRef.current.cols !== g.cols)
          coRef.current = emptyCoActivation(g.rows, g.cols)
        if (g.routedCount > 0) {
          addSnapshot(coRef.current, g)
          const act = activitiesRef.current[activitiesRef.current.length - 1]
          if (act) {
            if (!act.counts || act.rows !== g.rows || act.cols !== g.cols) {
              act.counts = new Float64Array(g.rows * g.cols)
              act.rows = g.rows
              act.cols = g.cols
            }
            for (let i = 0; i < g.routed.length; i++) act.counts[i] += g.routed[i]
            act.samples++
          }
          setCoVersion((v) => v + 1)
        }
      }
  }
  usePoll(() => pollExperts.current(), generating ? 250 : 1500, coli)

  const setGenerating = useCallback(
    (v: boolean) => {
      setGeneratingState(v)
      if (!v && coli) pollExperts.current().catch(() => {}) // the turn's last step, at once
    },
    [coli],
  )

  const beginActivity = useCallback((label: string) => {
    const list = activitiesRef.current
    list.push({ label, samples: 0, counts: null, rows: 0, cols: 0 })
    if (list.length > MAX_ACTIVITIES) list.splice(0, list.length - MAX_ACTIVITIES)
  }, [])

  const refreshProfile = useCallback(() => {
    if (!coli) return
    getJSON<ProfileData>(settings, '/profile')
      .then(setProfile)
      .catch(onError)
  }, [settings, coli, onError])

  usePoll(refreshProfile, 3000, coli)

  const model = settings.model || models[0] || ''
  const store: Store = {
    settings,
    setSettings,
    needKey,
    setNeedKey,
    coli,
    models,
    model,
    health,
    reachable,
    grid,
    co: coRef.current,
    coVersion,
    resetHistory,
    profile,
    refreshProfile,
    generating,
    setGenerating,
    beginActivity,
    activities: activitiesRef.current,
    onError,
  }
  return <Ctx.Provider value={store}>{children}</Ctx.Provider>
}
