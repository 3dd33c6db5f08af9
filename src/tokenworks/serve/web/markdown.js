// Markdown to DOM nodes, built with createElement and textContent only: whatever the text
// holds (<script>, an <img onerror>, a javascript: link) is shown as text, never run.
// Covers what models and `bench report` write: headings, paragraphs, lists, quotes,
// fenced code, tables, rules, and inline code, bold, italics and links.

const SAFE_LINK = /^(https?:\/\/|\/(?!\/)|#)/i;

function text(s) {
  return document.createTextNode(s);
}

// Inline spans: `code`, **bold**, *italic* / _italic_, [text](url), ![alt](src).
// image(src, alt) makes an image node, where a caller allows them (the lab's reports).
export function inline(s, image) {
  const out = document.createDocumentFragment();
  const pattern = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([\s\S]+?)\*\*|(?<![\w*])\*(?!\s)([^*]+?)\*(?![\w*])|(?<!\w)_(?!\s)([^_]+?)_(?!\w)|(!?)\[([^\]]*)\]\(([^)\s]*)(?:\s+"[^"]*")?\)/g;
  let last = 0;
  for (const m of s.matchAll(pattern)) {
    if (m.index > last) out.append(text(s.slice(last, m.index)));
    last = m.index + m[0].length;
    if (m[1]) {
      const code = document.createElement("code");
      code.textContent = m[2];
      out.append(code);
    } else if (m[3] !== undefined) {
      const b = document.createElement("strong");
      b.append(inline(m[3], image));
      out.append(b);
    } else if (m[4] !== undefined || m[5] !== undefined) {
      const i = document.createElement("em");
      i.append(inline(m[4] !== undefined ? m[4] : m[5], image));
      out.append(i);
    } else if (m[6] === "!") {
      out.append(image ? image(m[8], m[7]) : text(m[0]));
    } else {
      const url = m[8];
      if (SAFE_LINK.test(url)) {
        const a = document.createElement("a");
        a.href = url;
        a.rel = "noopener noreferrer";
        a.target = "_blank";
        a.append(inline(m[7], image));
        out.append(a);
      } else {
        out.append(text(m[0])); // an unsafe link stays as the text it was
      }
    }
  }
  if (last < s.length) out.append(text(s.slice(last)));
  return out;
}

function cells(line) {
  let row = line.trim();
  if (row.startsWith("|")) row = row.slice(1);
  if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
  return row.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
}

const FENCE = /^\s*(```+|~~~+)\s*([\w+-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*?)\s*#*\s*$/;
const ITEM = /^(\s*)([-*+]|\d+[.)])\s+(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

export function render(source, image) {
  const root = document.createDocumentFragment();
  const lines = source.replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i++;
    } else if ((m = line.match(FENCE))) {
      const body = [];
      i++;
      while (i < lines.length && !lines[i].trim().startsWith(m[1])) body.push(lines[i++]);
      i++; // the closing fence (or the end: an answer still streaming)
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      if (m[2]) code.dataset.lang = m[2];
      code.textContent = body.join("\n");
      pre.append(code);
      root.append(pre);
    } else if ((m = line.match(HEADING))) {
      const h = document.createElement("h" + Math.min(6, m[1].length + 2));
      h.append(inline(m[2], image));
      root.append(h);
      i++;
    } else if (RULE.test(line)) {
      root.append(document.createElement("hr"));
      i++;
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      const table = document.createElement("table");
      const head = table.createTHead().insertRow();
      for (const c of cells(line)) {
        const th = document.createElement("th");
        th.append(inline(c, image));
        head.append(th);
      }
      const body = table.createTBody();
      i += 2;
      while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
        const row = body.insertRow();
        for (const c of cells(lines[i])) row.insertCell().append(inline(c, image));
        i++;
      }
      const wrap = document.createElement("div");
      wrap.className = "table";
      wrap.append(table);
      root.append(wrap);
    } else if (/^\s*>/.test(line)) {
      const quoted = [];
      while (i < lines.length && /^\s*>/.test(lines[i])) quoted.push(lines[i++].replace(/^\s*>\s?/, ""));
      const q = document.createElement("blockquote");
      q.append(render(quoted.join("\n"), image));
      root.append(q);
    } else if ((m = line.match(ITEM))) {
      const ordered = /\d/.test(m[2]);
      const list = document.createElement(ordered ? "ol" : "ul");
      const indent = m[1].length;
      while (i < lines.length) {
        const item = lines[i].match(ITEM);
        if (!item || item[1].length !== indent || /\d/.test(item[2]) !== ordered) break;
        const body = [item[3]];
        i++;
        while (i < lines.length && lines[i].trim() && !ITEM.test(lines[i]) && /^\s{2,}/.test(lines[i])) {
          body.push(lines[i++].trim());
        }
        const nested = [];
        while (i < lines.length && ITEM.test(lines[i]) && lines[i].match(ITEM)[1].length > indent) {
          nested.push(lines[i++]);
        }
        const li = document.createElement("li");
        li.append(inline(body.join(" "), image));
        if (nested.length) li.append(render(nested.join("\n"), image));
        list.append(li);
      }
      root.append(list);
    } else {
      const para = [];
      while (i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i]) && !ITEM.test(lines[i]) && !/^\s*>/.test(lines[i])) {
        para.push(lines[i++]);
      }
      if (!para.length) para.push(lines[i++]);
      const p = document.createElement("p");
      para.forEach((l, j) => {
        if (j) p.append(document.createElement("br"));
        p.append(inline(l, image));
      });
      root.append(p);
    }
  }
  return root;
}
