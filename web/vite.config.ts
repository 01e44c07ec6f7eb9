import { defineConfig } from 'vitest/config'
import react from '@vitejs/plugin-react'

// The build goes into the Python package (coli/web_dist) so `pip install .` needs no Node.
// Deterministic: no timestamps, content hashes only; relative base so it works under any prefix.
export default defineConfig({
  plugins: [react()],
  base: './',
  build: {
    outDir: process.env.COLI_WEB_OUT || '../coli/web_dist',
    emptyOutDir: true,
    sourcemap: false,
    reportCompressedSize: false,
    chunkSizeWarningLimit: 1024,
    rollupOptions: { output: { manualChunks: undefined } },
  },
  server: {
    // `npm run dev` next to a running `coli serve` on :8000
    proxy: Object.fromEntries(
      ['/v1', '/health', '/experts', '/profile', '/metrics', '/openapi.json'].map((p) => [p, 'http://127.0.0.1:8000']),
    ),
  },
  test: { include: ['src/**/*.test.ts'], environment: 'node' },
})
