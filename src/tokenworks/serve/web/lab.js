// The lab: every evidence record in the server's records folder, newest first, with the
// command that wrote it, the book's chapters it measures and its plot; and the reports
// `tokenworks bench report` wrote there, rendered.

import { api, blobUrl, errorText, el } from "/ui/api.js";
import { render } from "/ui/markdown.js";

const $ = (id) => document.getElementById(id);
const files = (name) => "/lab/files/" + encodeURIComponent(name);

// Plots load as they scroll into view: each is fetched with the key.
const lazy = new IntersectionObserver((entries) => {
  for (const entry of entries) {
    if (!entry.isIntersecting) continue;
    const img = entry.target;
    lazy.unobserve(img);
    blobUrl(files(img.dataset.file)).then((url) => { img.src = url; }, () => { img.alt = "plot not found"; });
  }
});

function plot(name, alt) {
  const img = el("img", { alt: alt || name, class: "plot", "data-file": name });
  lazy.observe(img);
  return img;
}

function when(unix) {
  return unix ? new Date(unix * 1000).toISOString().slice(0, 16).replace("T", " ") : "";
}

async function showRecord(name) {
  const response = await api(files(name));
  $("record-json").textContent = response.ok ? JSON.stringify(await response.json(), null, 1) : await errorText(response);
  $("record-dialog").showModal();
}

async function showReport(name) {
  const view = $("report-view");
  const response = await api(files(name));
  if (!response.ok) {
    view.replaceChildren(el("p", { class: "error", text: await errorText(response) }));
  } else {
    const image = (src, alt) => (/^[\w.-]+\.png$/.test(src) ? plot(src, alt) : document.createTextNode(alt));
    view.replaceChildren(el("h2", { text: name }), render(await response.text(), image));
  }
  view.hidden = false;
  view.scrollIntoView();
}

function rows(records) {
  return records.map((r) => {
    const chapters = r.chapters.map((c) => c.number + " " + c.title).join("; ");
    const open = el("button", { type: "button", class: "link", text: r.kind });
    open.addEventListener("click", () => showRecord(r.name));
    const tr = el("tr", { "data-search": [r.kind, r.model, chapters, r.command, r.name].join(" ").toLowerCase() },
      el("td", { text: when(r.created_unix) }),
      el("td", {}, open, r.status ? el("span", { class: "status", text: " " + r.status }) : ""),
      el("td", { text: r.model || "" }),
      el("td", { text: chapters }),
      el("td", {}, el("code", { text: r.command })),
      el("td", {}, r.plot ? plot(r.plot, r.kind + " plot") : ""));
    return tr;
  });
}

async function init() {
  const response = await api("/lab/records");
  if (!response.ok) {
    $("folder").textContent = await errorText(response);
    return;
  }
  const listing = await response.json();
  if (!listing.found) {
    $("folder").textContent = listing.folder
      ? "No records folder at " + listing.folder + ": give `tokenworks serve --records-dir DIR`, or write records there with `tokenworks bench ... --out DIR`."
      : "This server has no records folder (tokenworks serve --records-dir DIR).";
    return;
  }
  $("folder").textContent = listing.records.length + " records in " + listing.folder;
  const reports = listing.reports.map((r) => {
    const b = el("button", { type: "button", class: "link", text: r.name });
    b.addEventListener("click", () => showReport(r.name));
    return el("li", {}, b);
  });
  if (reports.length) $("reports").replaceChildren(el("h2", { text: "reports" }), el("ul", {}, ...reports));
  const tbody = $("records").tBodies[0];
  tbody.replaceChildren(...rows(listing.records));
  $("filter").addEventListener("input", () => {
    const q = $("filter").value.trim().toLowerCase();
    for (const tr of tbody.rows) tr.hidden = Boolean(q) && !tr.dataset.search.includes(q);
  });
}

init();
