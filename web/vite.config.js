// Builds the page into crates/ds4-server/webchat/ (committed; ds4-server embeds it with
// include_bytes!, see scripts/manifest.mjs). One JS and one CSS file, content-hashed names.
import { defineConfig } from 'vite';

export default defineConfig({
  base: '/',
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
