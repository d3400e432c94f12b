// Checks a ledger event's inclusion proof, and the consistency of two checkpoints,
// in the browser: RFC 9162 (2.1.3.2, 2.1.4.2) over SHA-256, and the checkpoints'
// C2SP signed-note Ed25519 signatures, by WebCrypto. It trusts only the verifier
// key in the page's field (which the auditor may replace with one held elsewhere):
// the event's bytes, the proof and the checkpoint are checked, not believed.
"use strict";

(function () {
  const enc = new TextEncoder();

  function b64(text) {
    const bin = atob(text.trim());
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  function concat(...parts) {
    const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
    let at = 0;
    for (const p of parts) {
      out.set(p, at);
      at += p.length;
    }
    return out;
  }

  function equal(a, b) {
    if (a.length !== b.length) return false;
    let diff = 0;
    for (let i = 0; i < a.length; i++) diff |= a[i] ^ b[i];
    return diff === 0;
  }

  async function sha256(bytes) {
    return new Uint8Array(await crypto.subtle.digest("SHA-256", bytes));
  }

  const leafHash = (data) => sha256(concat(new Uint8Array([0]), data));
  const nodeHash = (l, r) => sha256(concat(new Uint8Array([1]), l, r));

  // A verifier key: name+hexid+base64(0x01 || 32-byte Ed25519 key), its id checked.
  async function parseKey(vkey) {
    // The key's base64 may hold "+" itself: only the first two separate fields.
    const text = vkey.trim();
    const a = text.indexOf("+");
    const b = a < 0 ? -1 : text.indexOf("+", a + 1);
    if (a <= 0 || b < 0) throw new Error("the verifier key is not name+id+key");
    const [name, hexid, key] = [text.slice(0, a), text.slice(a + 1, b), text.slice(b + 1)];
    const raw = b64(key);
    if (raw.length !== 33 || raw[0] !== 1) throw new Error("the verifier key is not an Ed25519 key");
    const id = (await sha256(concat(enc.encode(name + "\n"), raw))).slice(0, 4);
    const hex = Array.from(id, (b) => b.toString(16).padStart(2, "0")).join("");
    if (hex !== hexid.toLowerCase()) throw new Error("the verifier key's id does not match its key");
    const pub = await crypto.subtle.importKey("raw", raw.slice(1), { name: "Ed25519" }, false, ["verify"]);
    return { name, id, pub };
  }

  // A checkpoint note, its signature by `key` checked: { origin, size, root }.
  async function openCheckpoint(note, key) {
    const text = note.replace(/\r\n/g, "\n");
    const cut = text.lastIndexOf("\n\n");
    if (cut < 0) throw new Error("the checkpoint has no signature lines");
    const body = text.slice(0, cut + 1);
    const lines = body.split("\n");
    if (lines.length < 4) throw new Error("the checkpoint's body is malformed");
    const size = BigInt(lines[1]);
    const root = b64(lines[2]);
    for (const line of text.slice(cut + 2).split("\n")) {
      const m = /^\u2014 (\S+) (\S+)$/.exec(line);
      if (!m || m[1] !== key.name) continue;
      const sig = b64(m[2]);
      if (sig.length !== 68 || !equal(sig.slice(0, 4), key.id)) continue;
      const ok = await crypto.subtle.verify("Ed25519", key.pub, sig.slice(4), enc.encode(body));
      if (!ok) throw new Error("the checkpoint's signature by " + key.name + " does not verify");
      return { origin: lines[0], size, root };
    }
    throw new Error("the checkpoint carries no signature by " + key.name);
  }

  // RFC 9162 2.1.3.2.
  async function rootFromInclusion(index, size, leaf, path) {
    let fn = BigInt(index);
    let sn = BigInt(size) - 1n;
    if (fn > sn) throw new Error("the event is not in a tree of this size");
    let r = leaf;
    for (const p of path) {
      if (sn === 0n) throw new Error("the proof is longer than the tree is deep");
      if ((fn & 1n) === 1n || fn === sn) {
        r = await nodeHash(p, r);
        if ((fn & 1n) === 0n) {
          while ((fn & 1n) === 0n && fn !== 0n) {
            fn >>= 1n;
            sn >>= 1n;
          }
        }
      } else {
        r = await nodeHash(r, p);
      }
      fn >>= 1n;
      sn >>= 1n;
    }
    if (sn !== 0n) throw new Error("the proof is shorter than the tree is deep");
    return r;
  }

  // RFC 9162 2.1.4.2: whether `path` proves the tree (first, firstRoot) a prefix of
  // (second, secondRoot).
  async function consistent(first, second, firstRoot, secondRoot, path) {
    if (first === second) return path.length === 0 && equal(firstRoot, secondRoot);
    if (first === 0n || first > second || path.length === 0) return false;
    let proof = path;
    if ((first & (first - 1n)) === 0n) proof = [firstRoot, ...path];
    let fn = first - 1n;
    let sn = second - 1n;
    while ((fn & 1n) === 1n) {
      fn >>= 1n;
      sn >>= 1n;
    }
    let fr = proof[0];
    let sr = proof[0];
    for (const c of proof.slice(1)) {
      if (sn === 0n) return false;
      if ((fn & 1n) === 1n || fn === sn) {
        fr = await nodeHash(c, fr);
        sr = await nodeHash(c, sr);
        if ((fn & 1n) === 0n) {
          while ((fn & 1n) === 0n && fn !== 0n) {
            fn >>= 1n;
            sn >>= 1n;
          }
        }
      } else {
        sr = await nodeHash(sr, c);
      }
      fn >>= 1n;
      sn >>= 1n;
    }
    return sn === 0n && equal(fr, firstRoot) && equal(sr, secondRoot);
  }

  function field(section, name) {
    const el = section.querySelector('[data-field="' + name + '"]');
    return el ? (el.value !== undefined && el.tagName !== "PRE" ? el.value : el.textContent) : "";
  }

  function show(result, ok, text) {
    result.textContent = text;
    result.dataset.outcome = ok ? "ok" : "fail";
    result.classList.toggle("ok", ok);
    result.classList.toggle("fail", !ok);
  }

  async function checkInclusion(section, result) {
    const key = await parseKey(field(section, "vkey"));
    const cp = await openCheckpoint(field(section, "checkpoint"), key);
    const proof = JSON.parse(section.querySelector('[data-field="proof"]').dataset.json);
    const event = b64(document.querySelector('[data-field="event"]').dataset.b64);
    const leaf = await leafHash(event);
    if (!equal(leaf, b64(proof.leaf_hash))) throw new Error("the event's bytes do not hash to the proof's leaf");
    if (BigInt(proof.size) !== cp.size) throw new Error("the proof is for another tree size than the checkpoint");
    const root = await rootFromInclusion(proof.index, proof.size, leaf, proof.hashes.map(b64));
    if (!equal(root, cp.root)) throw new Error("the proof leads to another root than the signed one");
    show(result, true, "Verified in this browser: event " + proof.index + " is in " + cp.origin +
      " at size " + cp.size + ", under a checkpoint signed by " + key.name +
      ". This check needed nothing but the verifier key.");
  }

  async function checkConsistency(section, result) {
    const key = await parseKey(field(section, "vkey"));
    const old = await openCheckpoint(field(section, "old-checkpoint"), key);
    const now = await openCheckpoint(field(section, "checkpoint"), key);
    if (old.origin !== now.origin) throw new Error("the checkpoints are of different logs");
    if (old.size > now.size) throw new Error("your checkpoint is larger than today's log");
    const url = section.dataset.proofUrl.replace("{old}", old.size).replace("{new}", now.size);
    const resp = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!resp.ok) throw new Error("the server gave no consistency proof (" + resp.status + ")");
    const proof = await resp.json();
    const ok = await consistent(old.size, now.size, old.root, now.root, proof.hashes.map(b64));
    if (!ok) throw new Error("the log of today does not extend your checkpoint: it was rewritten");
    show(result, true, "Verified in this browser: the log at size " + now.size +
      " extends your checkpoint of size " + old.size + " unchanged; both signed by " + key.name + ".");
  }

  function wire(section, check) {
    const button = section.querySelector("button[data-verify]");
    const result = section.querySelector("[data-result]");
    if (!button || !result) return;
    result.textContent = "Not checked yet.";
    button.addEventListener("click", () => {
      delete result.dataset.outcome;
      result.textContent = "Checking...";
      if (!window.crypto || !crypto.subtle) {
        show(result, false, "This browser gives no WebCrypto here (it needs HTTPS or localhost).");
        return;
      }
      check(section, result).catch((err) => show(result, false, "Not verified: " + err.message));
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    const inclusion = document.querySelector('section[data-proof="inclusion"]');
    const consistency = document.querySelector('section[data-proof="consistency"]');
    if (inclusion) wire(inclusion, checkInclusion);
    if (consistency) wire(consistency, checkConsistency);
  });
})();
