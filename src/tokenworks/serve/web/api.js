// Requests to this page's own server, with the API key where one is needed. The key is
// asked for once (on the first 401) and kept in this browser's local storage.

const KEY = "tokenworks.api_key";

export function apiKey() {
  return localStorage.getItem(KEY) || "";
}

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

let asking = null;

// The key dialog, made the first time it is needed.
function keyDialog() {
  let dialog = document.getElementById("key-dialog");
  if (!dialog) {
    const input = el("input", { id: "key-input", type: "password", autocomplete: "off" });
    dialog = el("dialog", { id: "key-dialog" },
      el("form", { method: "dialog", id: "key-form" },
        el("p", { text: "This server needs an API key (it answered 401)." }),
        el("label", {}, "API key ", input),
        el("button", { type: "submit", text: "use this key" })));
    document.body.append(dialog);
  }
  return dialog;
}

// Show the key dialog and resolve once a key is given.
export function askForKey() {
  if (asking) return asking;
  const dialog = keyDialog();
  const input = document.getElementById("key-input");
  asking = new Promise((resolve) => {
    dialog.addEventListener("close", function done() {
      dialog.removeEventListener("close", done);
      localStorage.setItem(KEY, input.value.trim());
      input.value = "";
      asking = null;
      resolve();
    });
    dialog.showModal();
    input.focus();
  });
  return asking;
}

// fetch() on this server; a 401 asks for the key and tries once more.
export async function api(path, options) {
  const opts = Object.assign({}, options || {});
  for (let attempt = 0; ; attempt++) {
    opts.headers = headers(options && options.headers);
    const response = await fetch(path, opts);
    if (response.status !== 401 || attempt > 0) return response;
    await askForKey();
  }
}

// The error message of a refused request (both protocols' error objects), or its status.
export async function errorText(response) {
  try {
    const body = await response.json();
    const e = body.error || {};
    return (e.message || JSON.stringify(body)) + " (" + response.status + ")";
  } catch (_) {
    return "HTTP " + response.status;
  }
}

// A file of the records folder as an object URL (images cannot carry the key themselves).
export async function blobUrl(path) {
  const response = await api(path);
  if (!response.ok) throw new Error(await errorText(response));
  return URL.createObjectURL(await response.blob());
}

export function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}
