// Per-answer statistics from the server's usage fields (docs/server.md §7.1) and the
// page's own clock. ds4-server reports P prompt tokens, R of them reused from a cache
// (`prompt_tokens_details.cached_tokens`), W = P − R evaluated (`cache_write_tokens`) and C
// generated; the times are measured here: request sent → first streamed token (prefill,
// plus queueing and the network) → last token.

export function computeStats({ usage, tStart, tFirst, tEnd, ctx }) {
  if (!usage) return null;
  const prompt = usage.prompt_tokens ?? 0;
  const completion = usage.completion_tokens ?? 0;
  const det = usage.prompt_tokens_details || {};
  const reused = det.cached_tokens ?? 0;
  const fresh = det.cache_write_tokens ?? usage.cache_write_tokens ?? Math.max(0, prompt - reused);
  const s = { prompt, reused, fresh, completion, prefillTps: null, genTps: null, ctxUsed: prompt + completion, ctx: ctx || null };
  if (tFirst != null && tStart != null && tFirst > tStart && fresh > 0) {
    s.prefillTps = fresh / ((tFirst - tStart) / 1000);
  }
  if (tEnd != null && tFirst != null && tEnd > tFirst && completion > 1) {
    s.genTps = (completion - 1) / ((tEnd - tFirst) / 1000);
  }
  return s;
}

const fmt = (x) => (x >= 100 ? x.toFixed(0) : x.toFixed(1));

/** One line for the page: "prompt 120 (100 reused, 20 new) · 12.0 t/s prefill · …". */
export function statsLine(s) {
  if (!s) return '';
  const parts = [`prompt ${s.prompt} (${s.reused} reused, ${s.fresh} new)`, `${s.completion} generated`];
  if (s.prefillTps != null) parts.push(`prefill ${fmt(s.prefillTps)} t/s`);
  if (s.genTps != null) parts.push(`gen ${fmt(s.genTps)} t/s`);
  parts.push(s.ctx ? `context ${s.ctxUsed} / ${s.ctx}` : `context ${s.ctxUsed}`);
  return parts.join(' · ');
}
