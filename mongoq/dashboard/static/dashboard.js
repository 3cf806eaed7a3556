// The mongoq dashboard's only script: draws each primitive's chart from /api/samples and
// refreshes the overview's counts from /api/overview. Pages work without it.
"use strict";

const SVG = "http://www.w3.org/2000/svg";

function line(svg, values, css, top) {
  const known = values.map((v, i) => [i, v]).filter(([, v]) => v !== null);
  if (known.length === 0) return;
  const width = 240, height = 48, pad = 3;
  const step = values.length > 1 ? (width - 2 * pad) / (values.length - 1) : 0;
  const scale = top > 0 ? (height - 2 * pad) / top : 0;
  const points = known.map(([i, v]) => `${pad + i * step},${height - pad - v * scale}`);
  if (points.length === 1) points.push(`${width - pad},${points[0].split(",")[1]}`);
  const polyline = document.createElementNS(SVG, "polyline");
  polyline.setAttribute("class", css);
  polyline.setAttribute("points", points.join(" "));
  svg.appendChild(polyline);
}

function draw(samples) {
  for (const svg of document.querySelectorAll("svg.chart")) {
    const rows = samples.series[svg.dataset.key] || [];
    svg.replaceChildren();
    const backlog = rows.map((r) => r.backlog);
    const rates = rows.map((r) => r.per_minute);
    const title = document.createElementNS(SVG, "title");
    const last = rows[rows.length - 1];
    title.textContent = last
      ? `backlog ${last.backlog}, ${last.per_minute ?? "-"} finished/min (${rows.length} samples)`
      : "no samples yet";
    svg.appendChild(title);
    line(svg, backlog, "backlog", Math.max(1, ...backlog));
    line(svg, rates, "rate", Math.max(1, ...rates.filter((r) => r !== null)));
  }
}

function formatAge(seconds) {
  if (seconds === null) return "-";
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
  try {
    const samples = await (await fetch("/api/samples")).json();
    draw(samples);
    if (document.querySelector("table.overview")) {
      refreshCounts(await (await fetch("/api/overview")).json());
    }
    setTimeout(tick, Math.max(2, samples.interval) * 1000);
  } catch (error) {
    setTimeout(tick, 10000);
  }
}

if (document.querySelector("svg.chart, table.overview")) tick();
