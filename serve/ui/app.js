// edgeinfer's chat page: the server's own /v1 API from the browser. Conversations, settings and the
// API key are kept in this browser's localStorage; nothing is kept on the server. What the model
// writes is rendered as Markdown by maintained libraries and sanitized (see renderMarkdown), so its
// HTML and scripts never run.
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "schema", "tools", "tool_choice"];

const store = {
  get(key, fallback) {
    try {
      const value = localStorage.getItem("edgeinfer." + key);
      return value === null ? fallback : JSON.parse(value);
    } catch {
      return fallback;
    }
  },
  set(key, value) {
    localStorage.setItem("edgeinfer." + key, JSON.stringify(value));
  },
};

let conversations = store.get("conversations", []);
let currentId = store.get("current", null);
let running = null; // the reply being streamed: {controller, conversation}
let modelsLoading = false; // /health said the model is still loading
const SERVER_DOWN = "The server is not answering: is edgeinfer serve still running? Start it again, then resend.";

function save() {
  try {
    store.set("conversations", conversations);
    store.set("current", currentId);
  } catch {
    // the browser's storage is full (pictures take room): the page goes on, this change is not kept
    attachError("This browser's storage for the page is full: delete old conversations (pictures take the most room).");
  }
}

// Pictures for the next message: read in the browser as data: URLs, sent as the API's image_url
// parts, and kept with the message. Attached with the + button, pasted, or dropped on the page.
const MAX_PICTURE_BYTES = 3 * 1024 * 1024; // base64 makes it 4 MiB: the server's limit for a request
let attached = [];

function attach(files) {
  attachError(null);
  for (const file of files) {
    if (!/^image\/(png|jpeg|webp|gif|bmp)$/.test(file.type)) {
      attachError(`${file.name} is not a picture this page sends: PNG, JPEG, WebP, GIF or BMP.`);
    } else if (file.size > MAX_PICTURE_BYTES) {
      attachError(`${file.name} is over 3 MB: send a smaller picture.`);
    } else {
      const reader = new FileReader();
      reader.addEventListener("load", () => {
        attached.push(reader.result);
        showAttached();
      });
      reader.readAsDataURL(file);
    }
  }
}

function attachError(message) {
  $("attach-error").textContent = message || "";
  $("attach-error").hidden = !message;
}

function showAttached() {
  $("attached").replaceChildren(
    ...attached.map((url, index) => {
      const figure = element("figure");
      const remove = element("button", "remove");
      remove.type = "button";
      remove.textContent = "×";
      remove.setAttribute("aria-label", "Remove the picture");
      remove.addEventListener("click", () => {
        attached.splice(index, 1);
        showAttached();
      });
      figure.append(picture(url), remove);
      return figure;
    }),
  );
  $("attached").hidden = attached.length === 0;
}

function picture(url) {
  const image = element("img");
  image.src = url;
  image.alt = "a picture sent with the message";
  return image;
}

function current() {
  return conversations.find((c) => c.id === currentId) || null;
}

// The API key, asked for once (on the first 401) and kept in this browser.

function headers() {
  const key = store.get("apiKey", "");
  return key ? { "Content-Type": "application/json", Authorization: "Bearer " + key } : { "Content-Type": "application/json" };
}

function askKey(message) {
  const dialog = $("key-dialog");
  $("key-error").hidden = !message;
  $("key-error").textContent = message || "";
  $("key").value = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      store.set("apiKey", $("key").value.trim());
      resolve();
    }, { once: true });
    dialog.showModal();
  });
}

async function api(path, options = {}) {
  for (;;) {
    const response = await fetch(path, { ...options, headers: headers() });
    if (response.status !== 401) {
      return response;
    }
    const body = await response.json().catch(() => ({}));
    await askKey(store.get("apiKey", "") ? (body.error && body.error.message) || "That key was refused." : "");
  }
}

// Models.

async function loadModels() {
  let response;
  try {
    response = await api("/v1/models");
    const health = await fetch("/health");
    modelsLoading = health.status === 503;
    $("notice").hidden = !modelsLoading;
    $("notice").textContent = modelsLoading ? "The model is loading: the first reply waits for it." : "";
  } catch {
    $("notice").textContent = SERVER_DOWN;
    $("notice").hidden = false;
    return;
  }
  if (modelsLoading) {
    setTimeout(loadModels, 1000); // until it has loaded
  }
  const models = response.ok ? (await response.json()).data.map((m) => m.id) : [];
  const picker = $("model");
  picker.replaceChildren(...models.map((id) => new Option(id, id)));
  const wanted = (current() && current().model) || store.get("model", models[0]);
  if (models.includes(wanted)) {
    picker.value = wanted;
  }
}

function element(tag, className) {
  const node = document.createElement(tag);
  if (className) {
    node.className = className;
  }
  return node;
}

// Markdown: marked renders it (GitHub's flavour; a line break where the model wrote one), the model's
// own HTML shown as text, $…$, \(…\), $$…$$ and \[…\] typeset by KaTeX as MathML (no fonts, no inline
// style); DOMPurify then keeps only harmless markup (no script, no handler, no javascript: link), and
// highlight.js colours code. The libraries are fetched at build time (serve/ui_vendor.py): without
// them, or should one fail, a reply shows as plain text.

const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

function mathRule(name, level, pattern, starts) {
  return {
    name,
    level,
    start: (src) => {
      const at = src.search(starts);
      return at < 0 ? undefined : at;
    },
    tokenizer(src) {
      const match = pattern.exec(src);
      if (match) {
        const display = match[1] !== undefined || match[2] !== undefined;
        return { type: name, raw: match[0], text: match.slice(1).find((part) => part !== undefined), display };
      }
    },
    renderer: (token) => katex.renderToString(token.text.trim(), { displayMode: token.display, output: "mathml", throwOnError: false }),
  };
}

// inline $…$ needs a non-space after the opening and before the closing $, and no digit after it,
// so that "$5 and $10" stays text
const MATH = [
  mathRule("mathBlock", "block", /^(?:\$\$([\s\S]+?)\$\$|\\\[([\s\S]+?)\\\])[ \t]*(?:\n+|$)/, /^ {0,3}(?:\$\$|\\\[)/m),
  mathRule("mathInline", "inline", /^(?:\$\$([^$]+?)\$\$|\\\[([\s\S]+?)\\\]|\\\(([\s\S]+?)\\\)|\$(?=\S)([^$\n]*?\S)\$(?!\d))/, /\$|\\[([]/),
];

const markdown = (() => {
  if (typeof marked !== "object" || typeof DOMPurify !== "function") {
    return null;
  }
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") {
      node.setAttribute("target", "_blank"); // a link opens beside the page, not over it
      node.setAttribute("rel", "noopener noreferrer");
    }
  });
  const html = (token) => (token.block ? `<p>${escapeHtml(token.text)}</p>` : escapeHtml(token.text));
  return new marked.Marked({ gfm: true, breaks: true, renderer: { html }, extensions: typeof katex === "object" ? MATH : [] });
})();

// KaTeX's MathML keeps the TeX in <semantics><annotation>, which browsers do not draw: kept as
// markup, else DOMPurify would leave its text beside the formula
const PURIFY = { RETURN_DOM_FRAGMENT: true, ADD_ATTR: ["target"], ADD_TAGS: ["semantics", "annotation"] };

function renderMarkdown(text, into, pending) {
  into.replaceChildren();
  into.classList.toggle("plain", !markdown);
  if (!markdown) {
    into.textContent = text;
    return;
  }
  try {
    into.append(DOMPurify.sanitize(markdown.parse(text), PURIFY));
  } catch (error) {
    console.warn("Markdown failed, shown as text:", error);
    into.classList.add("plain");
    into.textContent = text;
    return;
  }
  if (typeof hljs === "object") {
    for (const code of into.querySelectorAll("pre code")) {
      // a streaming reply's code is coloured when it names its language; guessing one waits for the end
      if (!pending || /\blanguage-/.test(code.className)) {
        hljs.highlightElement(code);
      }
    }
  }
}

// The page.

function render() {
  const list = $("conversations");
  list.replaceChildren(
    ...conversations.map((c) => {
      const item = element("li", c.id === currentId ? "current" : "");
      item.textContent = c.title || "New chat";
      item.dataset.id = c.id;
      return item;
    }),
  );
  const messages = $("messages");
  messages.replaceChildren(...(current() ? current().messages.map((m, i) => renderMessage(m, i)) : []));
  messages.scrollTop = messages.scrollHeight;
}

function renderMessage(message, index) {
  const box = element("div", `message ${message.role}${message.error ? " error" : ""}`);
  const role = element("div", "role");
  role.textContent = message.role === "user" ? "You" : message.model || "assistant";
  const body = element("div", "body");
  if (message.images && message.images.length) {
    const pictures = element("div", "pictures");
    pictures.append(...message.images.map(picture));
    box.append(pictures);
  }
  renderMarkdown(message.content, body, message.pending);
  for (const pre of body.querySelectorAll("pre")) {
    pre.append(copyButton(() => pre.querySelector("code").textContent, "Copy code"));
  }
  box.append(role, body);
  if (message.pending && !message.content) {
    const waiting = element("div", "waiting");
    waiting.textContent = modelsLoading ? "The model is loading…" : "Waiting for the first token…";
    box.append(waiting);
  }
  if (!message.pending && index !== undefined) {
    box.append(actions(message, index));
  }
  for (const call of message.tool_calls || []) {
    const line = element("div", "tool-call");
    line.textContent = `${call.name}(${call.arguments})`;
    box.append(line);
  }
  if (message.cut_tool_call) {
    const line = element("div", "tool-call cut");
    const call = message.cut_tool_call;
    line.textContent = `${call.name}(${call.arguments}… cut: the reply ran out of tokens, raise Max tokens`;
    box.append(line);
  }
  const notes = [];
  if (message.stats) {
    const s = message.stats;
    notes.push(`${s.tokens} tokens`, `TTFT ${Math.round(s.ttft_ms)} ms`);
    if (s.tokens_per_s) {
      notes.push(`${s.tokens_per_s.toFixed(1)} tok/s`);
    }
  }
  if (message.stopped) {
    notes.push("stopped");
  }
  if (message.error) {
    notes.push(message.error);
  }
  if (notes.length) {
    const stats = element("div", "stats");
    stats.textContent = notes.join(" · ");
    box.append(stats);
  }
  return box;
}

function copyButton(text, label) {
  const button = element("button", "copy");
  button.type = "button";
  button.textContent = "Copy";
  button.setAttribute("aria-label", label);
  button.addEventListener("click", () => {
    navigator.clipboard.writeText(text()).then(() => (button.textContent = "Copied"), () => (button.textContent = "Copy failed"));
  });
  return button;
}

// A message's own buttons: copy it; edit a question (it goes back to the composer, and what came
// after it goes); regenerate the last reply; delete a message.
function actions(message, index) {
  const bar = element("div", "actions");
  bar.append(copyButton(() => message.content, "Copy message"));
  const conversation = current();
  const last = conversation && index === conversation.messages.length - 1;
  const button = (label, handler) => {
    const b = element("button", label.toLowerCase());
    b.type = "button";
    b.textContent = label;
    b.addEventListener("click", () => !running && handler());
    bar.append(b);
  };
  if (message.role === "user") {
    button("Edit", () => {
      $("input").value = message.content;
      attached = (message.images || []).slice();
      showAttached();
      conversation.messages.splice(index);
      save();
      render();
      $("input").focus();
    });
  }
  if (message.role === "assistant" && last) {
    button("Regenerate", () => regenerate(conversation));
  }
  button("Delete", () => {
    conversation.messages.splice(index, 1);
    save();
    render();
  });
  return bar;
}

async function regenerate(conversation) {
  conversation.messages.pop();
  const reply = { role: "assistant", content: "", model: conversation.model, pending: true };
  let body;
  try {
    body = requestBody(conversation, readSettings());
  } catch (error) {
    $("settings-error").textContent = "Settings: " + error.message;
    $("settings-error").hidden = false;
    return;
  }
  conversation.messages.push(reply);
  save();
  render();
  await stream(conversation, reply, body);
}

function newConversation() {
  const conversation = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "", model: $("model").value, messages: [] };
  conversations.unshift(conversation);
  currentId = conversation.id;
  save();
  return conversation;
}

function readSettings() {
  const settings = Object.fromEntries(SETTINGS.map((name) => [name, $(name).value]));
  store.set("settings", settings);
  return settings;
}

// A message's content as the API takes it: its pictures (image_url parts) before its text.
function content(message) {
  if (!message.images || !message.images.length) {
    return message.content;
  }
  return [...message.images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text: message.content }];
}

function requestBody(conversation, settings) {
  const history = conversation.messages.filter((m) => !m.error && !m.pending).map((m) => ({ role: m.role, content: content(m) }));
  const body = { model: conversation.model, messages: settings.system.trim() ? [{ role: "system", content: settings.system }, ...history] : history };
  Object.assign(body, { stream: true, stream_options: { include_usage: true } });
  for (const [name, parse] of [["temperature", Number], ["top_p", Number], ["max_tokens", (v) => parseInt(v, 10)]]) {
    if (settings[name].trim()) {
      body[name] = parse(settings[name]);
    }
  }
  if (settings.schema.trim()) {
    body.response_format = { type: "json_schema", json_schema: { name: "reply", schema: JSON.parse(settings.schema) } };
  }
  if (settings.tools.trim()) {
    body.tools = JSON.parse(settings.tools);
    if (settings.tool_choice) {
      body.tool_choice = settings.tool_choice;
    }
  }
  return body;
}

async function send(event) {
  event.preventDefault();
  const text = $("input").value;
  if ((!text.trim() && !attached.length) || running) {
    return;
  }
  let body;
  const conversation = current() || newConversation();
  conversation.model = $("model").value;
  conversation.messages.push(attached.length ? { role: "user", content: text, images: attached.slice() } : { role: "user", content: text });
  try {
    body = requestBody(conversation, readSettings());
    $("settings-error").hidden = true;
  } catch (error) {
    conversation.messages.pop();
    $("settings-error").textContent = "Settings: " + error.message;
    $("settings-error").hidden = false;
    $("settings").hidden = false;
    return;
  }
  conversation.title = conversation.title || text.slice(0, 48) || "A picture";
  $("input").value = "";
  attached = [];
  showAttached();
  const reply = { role: "assistant", content: "", model: conversation.model, pending: true };
  conversation.messages.push(reply);
  save();
  render();
  await stream(conversation, reply, body);
}

async function stream(conversation, reply, body) {
  running = { controller: new AbortController(), conversation };
  $("send").hidden = true;
  $("stop").hidden = false;
  const start = performance.now();
  let first = null;
  let last = null;
  let chunks = 0;
  let usage = null;
  const calls = [];
  try {
    const response = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body), signal: running.controller.signal });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error((error.error && error.error.message) || `${response.status} ${response.statusText}`);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffered = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) {
        break;
      }
      buffered += decoder.decode(value, { stream: true });
      const events = buffered.split("\n\n");
      buffered = events.pop();
      for (const event of events) {
        const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (!data || data === "[DONE]") {
          continue;
        }
        const chunk = JSON.parse(data);
        if (chunk.error) {
          throw new Error(chunk.error.message);
        }
        usage = chunk.usage || usage;
        const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
        for (const call of delta.tool_calls || []) {
          calls[call.index] = calls[call.index] || { name: "", arguments: "" };
          calls[call.index].name += (call.function && call.function.name) || "";
          calls[call.index].arguments += (call.function && call.function.arguments) || "";
        }
        if (delta.content || delta.tool_calls) {
          const now = performance.now();
          first = first === null ? now : first;
          last = now;
          chunks += 1;
          reply.content += delta.content || "";
          reply.tool_calls = calls.filter(Boolean);
          showSoon(reply);
        }
        const cut = chunk.choices && chunk.choices[0] && chunk.choices[0].cut_tool_call;
        if (cut) {
          // the reply ended inside this call: as the API does, it is not among the calls made
          delete calls[cut.index];
          reply.tool_calls = calls.filter(Boolean);
          reply.cut_tool_call = { name: cut.function.name, arguments: cut.function.arguments };
        }
      }
    }
  } catch (error) {
    if (error.name === "AbortError") {
      reply.stopped = true;
    } else {
      reply.error = error instanceof TypeError ? SERVER_DOWN : error.message; // fetch's own failure: no answer at all
    }
  } finally {
    const tokens = usage ? usage.completion_tokens : chunks;
    if (first !== null) {
      // the decode rate as this browser saw the tokens come; too short a stream (its chunks arriving
      // together) gives none
      const rate = tokens > 1 && last - first >= 50 ? (tokens - 1) / ((last - first) / 1000) : null;
      reply.stats = { tokens, ttft_ms: first - start, tokens_per_s: rate };
    }
    delete reply.pending;
    running = null;
    if (frame !== null) {
      cancelAnimationFrame(frame);
      frame = null;
    }
    $("send").hidden = false;
    $("stop").hidden = true;
    save();
    render();
  }
}

// A stream's chunks come faster than a page can be drawn: the reply is drawn once a frame, so that the
// page (its Stop button) stays responsive however fast the model writes.
let frame = null;

function showSoon(reply) {
  if (frame === null) {
    frame = requestAnimationFrame(() => {
      frame = null;
      showReply(reply);
    });
  }
}

function showReply(reply) {
  const boxes = $("messages").querySelectorAll(".message");
  const box = boxes[boxes.length - 1];
  if (box) {
    box.replaceWith(renderMessage(reply));
  }
  $("messages").scrollTop = $("messages").scrollHeight;
}

function closeDrawer() {
  $("sidebar").classList.remove("open");
}

// The theme: the system's (auto: it follows the system's changes), or dark or light as chosen here.
const SYSTEM_DARK = window.matchMedia("(prefers-color-scheme: dark)");

function applyTheme() {
  const theme = store.get("theme", "auto");
  document.documentElement.dataset.theme = theme === "auto" ? (SYSTEM_DARK.matches ? "dark" : "light") : theme;
  $("theme").textContent = { auto: "Theme: auto", dark: "Theme: dark", light: "Theme: light" }[theme];
}

function stop() {
  if (running) {
    running.controller.abort();
  }
}

function start() {
  for (const message of conversations.flatMap((c) => c.messages).filter((m) => m.pending)) {
    delete message.pending; // the page was left while it streamed
    message.stopped = true;
  }
  const settings = store.get("settings", {});
  for (const name of SETTINGS) {
    $(name).value = settings[name] || "";
    $(name).addEventListener("change", readSettings);
  }
  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      send(event);
    }
  });
  $("stop").addEventListener("click", stop);
  $("attach").addEventListener("click", () => $("picture").click());
  $("picture").addEventListener("change", () => {
    attach([...$("picture").files]);
    $("picture").value = "";
  });
  $("input").addEventListener("paste", (event) => {
    const files = [...event.clipboardData.files];
    if (files.length) {
      event.preventDefault();
      attach(files);
    }
  });
  for (const target of [$("messages"), $("composer")]) {
    target.addEventListener("dragover", (event) => event.preventDefault());
    target.addEventListener("drop", (event) => {
      event.preventDefault();
      attach([...event.dataTransfer.files]);
    });
  }
  $("new-chat").addEventListener("click", () => {
    if (!running) {
      currentId = null;
      save();
      render();
    }
    closeDrawer();
  });
  document.addEventListener("keydown", (event) => event.key === "Escape" && closeDrawer());
  $("messages").addEventListener("click", closeDrawer); // a tap outside the drawer closes it
  $("composer").addEventListener("click", closeDrawer);
  $("theme").addEventListener("click", () => {
    const next = { auto: "dark", dark: "light", light: "auto" }[store.get("theme", "auto")];
    store.set("theme", next);
    applyTheme();
  });
  SYSTEM_DARK.addEventListener("change", applyTheme);
  applyTheme();
  $("conversations").addEventListener("click", (event) => {
    const item = event.target.closest("li");
    if (item && !running) {
      currentId = item.dataset.id;
      save();
      render();
      if (current() && [...$("model").options].some((o) => o.value === current().model)) {
        $("model").value = current().model;
      }
      $("sidebar").classList.remove("open");
    }
  });
  $("model").addEventListener("change", () => store.set("model", $("model").value));
  $("toggle-settings").addEventListener("click", () => ($("settings").hidden = !$("settings").hidden));
  $("toggle-sidebar").addEventListener("click", (event) => {
    event.stopPropagation();
    $("sidebar").classList.toggle("open");
  });
  $("conversations").addEventListener("dblclick", (event) => {
    const item = event.target.closest("li");
    const conversation = item && conversations.find((c) => c.id === item.dataset.id);
    const title = conversation && window.prompt("Rename the conversation", conversation.title || "New chat");
    if (title && title.trim()) {
      conversation.title = title.trim().slice(0, 80);
      save();
      render();
    }
  });
  render();
  loadModels();
}

start();
