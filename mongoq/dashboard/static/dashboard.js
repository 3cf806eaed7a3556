// The mongoq dashboard's only script: every few seconds (the page's data-refresh) it swaps
// each chart for a fresh copy drawn by the server (/api/chart) and refreshes the overview's
// counts from /api/overview. Pages work without it: they are whole as served.
"use strict";

function formatAge(seconds) {
  if (seconds === null) return "-";
  if (seconds < 1) return "<1s"; // due work never reads as 0s
  let left = Math.floor(seconds);
  const parts = [];
  for (const [unit, size] of [["d", 86400], ["h", 3600], ["m", 60]]) {
    if (left >= size || parts.length) {
      parts.push(`${Math.floor(left / size)}${unit}`);
      left %= size;
    }
  }
  parts.push(`${left}s`);
  return parts.slice(0, 2).join("");
}

async function refreshChart(svg) {
  const query = new URLSearchParams({ key: svg.dataset.key, size: svg.dataset.size || "small" });
  const response = await fetch(`/api/chart?${query}`);
  if (!response.ok) return; // not sampled yet: the page's own copy stays
  const parsed = new DOMParser().parseFromString(await response.text(), "image/svg+xml");
  const fresh = parsed.documentElement;
  if (fresh.nodeName === "svg") svg.replaceWith(document.importNode(fresh, true));
}

function refreshCounts(overview) {
  for (const p of overview.primitives) {
    const age = document.querySelector(`[data-age="${CSS.escape(p.key)}"]`);
    if (age && p.error === null) age.textContent = formatAge(p.oldest_age);
    for (const [label, count] of Object.entries(p.counts)) {
      const cell = document.querySelector(`[data-count="${CSS.escape(p.key + ":" + label)}"]`);
      if (cell) cell.textContent = String(count);
    }
  }
}

async function tick() {
  const every = Math.max(2, Number(document.body.dataset.refresh) || 10) * 1000;
  try {
    await Promise.all([...document.querySelectorAll("svg.chart")].map(refreshChart));
    if (document.querySelector("table.overview")) {
      refreshCounts(await (await fetch("/api/overview")).json());
    }
  } catch (error) {
    // the dashboard restarting, the network away: try again at the next tick
  }
  setTimeout(tick, every);
}

if (document.querySelector("svg.chart, table.overview")) setTimeout(tick, 1000);
