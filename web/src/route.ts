// The page's address after '#': '#brain/explore/<region>/<L3E17>' -> ['brain', 'explore', ...].
// Views set it with go(parts); every useRoute() sees the change (also Back and Forward).
import { useCallback, useEffect, useState } from 'react'

export function parseHash(hash: string): string[] {
  return hash
    .replace(/^#\/?/, '')
    .split('/')
    .filter(Boolean)
    .map((p) => {
      try {
        return decodeURIComponent(p)
      } catch {
        return p
      }
    })
}

export function toHash(parts: string[]): string {
  return '#' + parts.map(encodeURIComponent).join('/')
}

export function useRoute(): [string[], (parts: string[], replace?: boolean) => void] {
  const [parts, setParts] = useState(() => parseHash(location.hash))
  useEffect(() => {
    const on = () => setParts(parseHash(location.hash))
    window.addEventListener('hashchange', on)
    return () => window.removeEventListener('hashchange', on)
  }, [])
  const go = useCallback((next: string[], replace = false) => {
    const h = toHash(next)
    if (location.hash === h) return
    if (replace) history.replaceState(null, '', h)
    else history.pushState(null, '', h)
    window.dispatchEvent(new HashChangeEvent('hashchange')) // pushState fires none: tell every useRoute
  }, [])
  return [parts, go]
}
