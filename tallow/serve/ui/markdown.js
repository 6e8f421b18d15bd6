// A small markdown renderer that builds DOM nodes (never HTML strings): model output can't
// become markup or script. Fenced code, inline code, headings, lists, quotes, paragraphs,
// **bold**, *italic*, and links whose URL is http(s) or mailto (any other link is plain text).

const SAFE_URL = /^(https?:|mailto:)/i;

export function render(text) {
  const root = document.createDocumentFragment();
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*(```|~~~)\s*([\w+.#-]*)/);
    if (fence) {
      const body = [];
      i++;
      while (i < lines.length && !lines[i].trimStart().startsWith(fence[1])) body.push(lines[i++]);
      i++;  // the closing fence (or the end of a reply still streaming)
      const pre = el("pre"), code = el("code");
      if (fence[2]) { code.dataset.lang = fence[2]; pre.dataset.lang = fence[2]; }
      code.textContent = body.join("\n");
      pre.append(code);
      root.append(pre);
      continue;
    }
    if (!line.trim()) { i++; continue; }
    const heading = line.match(/^(#{1,6})\s+(.*)/);
    if (heading) {
      const h = el("h" + Math.min(6, heading[1].length + 2));
      inline(h, heading[2]);
      root.append(h);
      i++;
      continue;
    }
    if (/^\s*([-*+]|\d+[.)])\s+/.test(line)) {
      const ordered = /^\s*\d/.test(line);
      const list = el(ordered ? "ol" : "ul");
      while (i < lines.length && /^\s*([-*+]|\d+[.)])\s+/.test(lines[i])) {
        const li = el("li");
        inline(li, lines[i].replace(/^\s*([-*+]|\d+[.)])\s+/, ""));
        list.append(li);
        i++;
      }
      root.append(list);
      continue;
    }
    if (line.startsWith(">")) {
      const quote = [];
      while (i < lines.length && lines[i].startsWith(">")) quote.push(lines[i++].replace(/^>\s?/, ""));
      const bq = el("blockquote");
      bq.append(render(quote.join("\n")));
      root.append(bq);
      continue;
    }
    const para = [];
    while (i < lines.length && lines[i].trim() && !/^(\s*(```|~~~)|#{1,6}\s|>|\s*([-*+]|\d+[.)])\s)/.test(lines[i])) {
      para.push(lines[i++]);
    }
    if (!para.length) para.push(lines[i++]);
    const p = el("p");
    para.forEach((l, k) => { if (k) p.append(el("br")); inline(p, l); });
    root.append(p);
  }
  return root;
}

// `code`, **bold**, *italic* / _italic_, [text](url)
const INLINE = /`([^`]+)`|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*|_([^_\s][^_]*)_|\[([^\]]*)\]\(([^)\s]*)\)/g;

function inline(parent, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    if (m[1] !== undefined) { const c = el("code"); c.textContent = m[1]; parent.append(c); }
    else if (m[2] !== undefined) { const b = el("strong"); inline(b, m[2]); parent.append(b); }
    else if (m[3] !== undefined || m[4] !== undefined) { const e = el("em"); inline(e, m[3] ?? m[4]); parent.append(e); }
    else {
      const url = m[6];
      if (SAFE_URL.test(url)) {
        const a = el("a");
        a.href = url;
        a.rel = "noopener noreferrer nofollow";
        a.target = "_blank";
        a.textContent = m[5] || url;
        parent.append(a);
      } else {
        parent.append(m[0]);  // an unsafe link (javascript:, data:, ...) stays text
      }
    }
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.append(text.slice(last));
}

function el(tag) { return document.createElement(tag); }
