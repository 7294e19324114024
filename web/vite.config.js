// Builds the page into crates/ds4-server/webchat/ (committed; ds4-server embeds it with
// include_bytes!, see scripts/manifest.mjs). One JS and one CSS file, content-hashed names.
import { defineConfig } from 'vite';

export default defineConfig({
  base: '/',
  // `npm run dev`: the page on :5173, the API proxied to a ds4-server on :8000.
  server: { proxy: { '/v1': 'http://127.0.0.1:8000', '/health': 'http://127.0.0.1:8000' } },
  build: {
    outDir: '../crates/ds4-server/webchat',
    emptyOutDir: true,
    assetsDir: 'assets',
    modulePreload: false,
    sourcemap: false,
    target: 'es2022',
    assetsInlineLimit: 0,
    chunkSizeWarningLimit: 1000,
  },
});
