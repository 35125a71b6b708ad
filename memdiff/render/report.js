// memdiff's HTML report: draws what memdiff measured (the JSON in #memdiff-data) as inline SVG.
// It computes nothing of its own beyond placing values on the screen: every figure is from the data.
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("memdiff-data").textContent);
  var NS = "http://www.w3.org/2000/svg";
  var COLORS = {
    parameter: "#4e79a7", gradient: "#f28e2b", optimizer_state: "#e15759", activation: "#59a14f",
    recomputed_activation: "#a6d49f", autograd: "#76b7b2", temporary: "#9370db", optimizer_temporary: "#d4a6c8",
    input: "#edc948",
    communication: "#b07aa1", workspace: "#79706e",
    untracked: "#9c755f", other: "#bab0ac"
  };
  var EXTRA = ["#ff9da7", "#86bcb6", "#d37295", "#a0cbe8", "#8cd17d", "#f1ce63", "#499894", "#fabfd2"];
  // One order of categories for the whole page: every stack (first at the bottom), the bars' lanes
  // (first at the top), the legend and the tooltips. The built-in categories in this order, what
  // lives longest first, then the rules' own categories, largest first, then "other".
  var CANONICAL = ["parameter", "optimizer_state", "gradient", "activation", "recomputed_activation", "autograd",
    "temporary", "optimizer_temporary", "input", "communication", "workspace", "untracked"];
  var PHASES = ["forward", "backward", "optimizer", "other"];
  var HEIGHT = 230, LEFT = 74, RIGHT = 12, TOP = 18, BOTTOM = 26, LANE = 24;
  var state = { x0: 0, x1: 1, time: false, overlay: false, selected: null };
  var tip = document.getElementById("tip");
  var detail = document.getElementById("detail");
  var redraws = [];

  function color(category) {
    if (COLORS[category]) return COLORS[category];
    var h = 0;
    for (var i = 0; i < category.length; i++) h = (h * 31 + category.charCodeAt(i)) >>> 0;
    return EXTRA[h % EXTRA.length];
  }

  function largest(values) {
    var m = 0;
    for (var i = 0; i < values.length; i++) if (values[i] > m) m = values[i];
    return m;
  }

  function categoryOrder() {
    var most = {};
    function see(c, b) { most[c] = Math.max(most[c] || 0, b || 0); }
    data.devices.forEach(function (d) { d.runs.forEach(function (r) {
      if (r.history) Object.keys(r.history.categories).forEach(function (c) { see(c, largest(r.history.categories[c])); });
      Object.keys(r.groups).forEach(function (sig) { see(r.groups[sig].category || "other", r.groups[sig].bytes); });
    }); });
    var rest = Object.keys(most).filter(function (c) { return CANONICAL.indexOf(c) < 0 && c !== "other"; });
    rest.sort(function (a, b) { return most[b] - most[a] || (a < b ? -1 : a > b ? 1 : 0); });
    return CANONICAL.filter(function (c) { return c in most; }).concat(rest, "other" in most ? ["other"] : []);
  }
  var ORDER = categoryOrder();

  function ordered(categories) { return ORDER.filter(function (c) { return c in categories; }); }

  // Sets `text` in `node`, cut at the end with an ellipsis where it is wider than `width` (user units).
  function fitText(node, text, width) {
    node.textContent = text;
    if (!(width > 0) || node.getComputedTextLength() <= width) return;
    var lo = 0, hi = text.length;
    while (hi - lo > 1) {
      var mid = (lo + hi) >> 1;
      node.textContent = text.slice(0, mid) + "\u2026";
      if (node.getComputedTextLength() <= width) lo = mid; else hi = mid;
    }
    node.textContent = text.slice(0, lo) + "\u2026";
  }

  function fmtBytes(n, signed) {
    var units = [[Math.pow(2, 40), "TiB"], [Math.pow(2, 30), "GiB"], [Math.pow(2, 20), "MiB"], [1024, "KiB"]];
    var sign = n < 0 ? "-" : (signed && n > 0 ? "+" : "");
    var a = Math.abs(n);
    for (var i = 0; i < units.length; i++) {
      if (a >= units[i][0]) return sign + (a / units[i][0]).toFixed(2) + " " + units[i][1];
    }
    return sign + a + " B";
  }

  function el(tag, attrs, parent, text) {
    var node = document.createElementNS(NS, tag);
    for (var k in attrs) node.setAttribute(k, attrs[k]);
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }

  function hasTime(run) { return !!(run.history && run.history.time_us && run.start_us !== null && run.end_us !== null); }

  // Where an event sits on the shared x axis: trace progress (0..1) or seconds into the run.
  function eventPos(run, e) {
    if (!state.time) return run.trace_events > 1 ? e / (run.trace_events - 1) : 0;
    var h = run.history, ev = h.events, t = h.time_us;
    if (!ev.length) return 0;
    var lo = 0, hi = ev.length - 1;
    if (e <= ev[0]) return (t[0] - run.start_us) / 1e6;
    if (e >= ev[hi]) return (t[hi] - run.start_us) / 1e6;
    while (hi - lo > 1) { var mid = (lo + hi) >> 1; if (ev[mid] <= e) lo = mid; else hi = mid; }
    var f = (e - ev[lo]) / Math.max(1, ev[hi] - ev[lo]);
    return (t[lo] + f * (t[hi] - t[lo]) - run.start_us) / 1e6;
  }

  function pointPos(run, k) {
    var h = run.history;
    if (state.time) return (h.time_us[k] - run.start_us) / 1e6;
    return eventPos(run, h.events[k]);
  }

  function domain(runs) {
    if (!state.time) return 1;
    var d = 0;
    runs.forEach(function (r) { d = Math.max(d, (r.end_us - r.start_us) / 1e6); });
    return d || 1;
  }

  function scales(runs, width, top) {
    var D = domain(runs), w = width - LEFT - RIGHT;
    var lo = state.x0 * D, hi = state.x1 * D;
    return {
      D: D, w: w,
      x: function (v) { return LEFT + (v - lo) / (hi - lo) * w; },
      inv: function (px) { return lo + (px - LEFT) / w * (hi - lo); },
      y: function (b) { return TOP + (1 - b / top) * (HEIGHT - TOP - BOTTOM); }
    };
  }

  function niceStep(span, count) {
    var raw = span / count, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    var steps = [1, 2, 2.5, 5, 10];
    for (var i = 0; i < steps.length; i++) if (steps[i] * mag >= raw) return steps[i] * mag;
    return 10 * mag;
  }

  function byteStep(top) {
    var unit = top >= Math.pow(2, 30) ? Math.pow(2, 30) : top >= Math.pow(2, 20) ? Math.pow(2, 20) : 1024;
    return niceStep(top / unit, 4) * unit;
  }

  function axes(svg, s, top) {
    var g = el("g", { "class": "axis grid" }, svg);
    var step = byteStep(top);
    for (var b = 0; b <= top * 1.0001; b += step) {
      el("line", { x1: LEFT, x2: LEFT + s.w, y1: s.y(b), y2: s.y(b) }, g);
      el("text", { x: LEFT - 6, y: s.y(b) + 4, "text-anchor": "end" }, g, fmtBytes(b));
    }
    // x ticks: a mark at each, its label centred on it but kept inside the chart (the last one,
    // 100% or the run's end, would otherwise hang half past the right edge and be cut).
    var lo = s.inv(LEFT), hi = s.inv(LEFT + s.w), xs = niceStep(hi - lo, 8), right = LEFT + s.w + RIGHT;
    for (var k = Math.ceil(lo / xs - 1e-9); k * xs <= hi + xs * 1e-9; k++) {
      var v = k * xs, x = s.x(v);
      var label = state.time ? (+v.toFixed(6)) + " s" : Math.round(v * 1000) / 10 + "%";
      el("line", { "class": "x-mark", x1: x, x2: x, y1: HEIGHT - BOTTOM, y2: HEIGHT - BOTTOM + 4 }, g);
      var t = el("text", { x: x, y: HEIGHT - 8, "text-anchor": "middle", "class": "x-tick" }, g, label);
      var half = t.getComputedTextLength() / 2;
      if (x + half > right - 1) t.setAttribute("x", right - 1 - half);
    }
  }

  function clip(svg, id) {
    var defs = el("defs", {}, svg);
    var cp = el("clipPath", { id: id }, defs);
    el("rect", { x: LEFT, y: 0, width: 10000, height: HEIGHT }, cp);
    return "url(#" + id + ")";
  }

  // The phases as shaded bands, each with a strip of its colour along the top (in the timelines,
  // where steps are also marked and named; the bars' lanes keep only the shading).
  function bands(g, run, s, y0, y1, timeline) {
    (run.bands || []).forEach(function (b) {
      var a = s.x(eventPos(run, b.start)), z = s.x(eventPos(run, b.end + 1));
      var name = (b.step === null ? "" : "step " + b.step + ", ") + b.phase;
      el("rect", { "class": "band band-" + b.phase, "data-phase": b.phase, x: a, y: y0, width: Math.max(0, z - a),
        height: y1 - y0 }, g).appendChild(el("title", {}, null, name));
      if (!timeline) return;
      el("rect", { "class": "band-edge band-edge-" + b.phase, x: a, y: y0, width: Math.max(0, z - a), height: 3 }, g);
      if (b.first) {
        el("line", { "class": "step-line", x1: a, x2: a, y1: y0, y2: y1 }, g);
        if (b.step !== null) el("text", { x: a + 3, y: y0 + 13, "class": "step-label" }, g, "step " + b.step);
      }
    });
  }

  function peakMarker(g, run, s) {
    if (run.peak_event === null) return;
    var x = s.x(eventPos(run, run.peak_event)), y = s.y(run.peak_bytes);
    var m = el("g", { "class": "peak-marker", "data-bytes": run.peak_bytes, "data-role": run.role }, g);
    el("line", { x1: x, x2: x, y1: y, y2: HEIGHT - BOTTOM }, m);
    el("circle", { cx: x, cy: y, r: 4 }, m);
    var right = x > LEFT + s.w * 0.7;
    el("text", { x: right ? x - 8 : x + 8, y: Math.max(y - 6, 12), "text-anchor": right ? "end" : "start",
      "class": "peak-label" }, m, run.role + " peak " + fmtBytes(run.peak_bytes));
  }

  function stacked(g, run, s) {
    var h = run.history, n = h.events.length, below = new Array(n).fill(0);
    var xs = [];
    for (var k = 0; k < n; k++) xs.push(s.x(pointPos(run, k)));
    ordered(h.categories).forEach(function (cat) {
      var values = h.categories[cat], up = [], down = [];
      for (var k = 0; k < n; k++) {
        down.push(xs[k].toFixed(1) + "," + s.y(below[k]).toFixed(1));
        below[k] += values[k];
        up.push(xs[k].toFixed(1) + "," + s.y(below[k]).toFixed(1));
      }
      el("path", { d: "M" + up.join("L") + "L" + down.reverse().join("L") + "Z", fill: color(cat),
        "class": "area", "data-category": cat }, g);
    });
  }

  function hover(svg, runs, s, describe) {
    var cursor = el("line", { "class": "cursor", y1: TOP, y2: HEIGHT - BOTTOM, visibility: "hidden" }, svg);
    svg.addEventListener("mousemove", function (ev) {
      var box = svg.getBoundingClientRect(), px = (ev.clientX - box.left) * (svg.viewBox.baseVal.width / box.width);
      if (px < LEFT) { hideTip(); cursor.setAttribute("visibility", "hidden"); return; }
      var v = s.inv(px);
      cursor.setAttribute("x1", px); cursor.setAttribute("x2", px); cursor.setAttribute("visibility", "visible");
      var parts = runs.filter(function (r) { return r.history && r.history.events.length; }).map(function (r) {
        var best = 0, dist = Infinity;
        for (var k = 0; k < r.history.events.length; k++) {
          var d = Math.abs(pointPos(r, k) - v);
          if (d < dist) { dist = d; best = k; }
        }
        return describe(r, best);
      });
      showTip(ev, parts);
    });
    svg.addEventListener("mouseleave", function () { hideTip(); cursor.setAttribute("visibility", "hidden"); });
  }

  function pointTable(run, k) {
    var h = run.history, rows = [[run.role + " event " + h.events[k].toLocaleString() +
      (h.time_us ? ", +" + ((h.time_us[k] - run.start_us) / 1e6).toFixed(3) + " s" : ""), fmtBytes(h.totals[k])]];
    ordered(h.categories).forEach(function (c) {
      if (h.categories[c][k]) rows.push([c, fmtBytes(h.categories[c][k]), color(c)]);
    });
    return rows;
  }

  function showTip(ev, parts) {
    tip.textContent = "";
    parts.forEach(function (rows) {
      var t = document.createElement("table");
      rows.forEach(function (r, i) {
        var tr = t.insertRow(), a = tr.insertCell(), b = tr.insertCell();
        if (r[2]) { var sw = document.createElement("i"); sw.style.cssText = "display:inline-block;width:9px;height:9px;margin-right:4px;background:" + r[2]; a.appendChild(sw); }
        a.appendChild(document.createTextNode(r[0])); b.textContent = r[1];
        if (i === 0) tr.style.fontWeight = "600";
      });
      tip.appendChild(t);
    });
    tip.style.display = "block";
    var x = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
    var y = Math.min(ev.clientY + 14, window.innerHeight - tip.offsetHeight - 8);
    tip.style.left = x + "px"; tip.style.top = y + "px";
  }

  function hideTip() { tip.style.display = "none"; }

  function timeline(host, dev, run, top, width) {
    var svg = el("svg", { "class": "timeline", viewBox: "0 0 " + width + " " + HEIGHT, tabindex: "0",
      role: "img", "data-role": run.role, "data-device": dev.device, "data-peak-bytes": run.peak_bytes,
      "aria-label": run.role + " memory over time, peak " + fmtBytes(run.peak_bytes) }, host);
    var s = scales([run].concat(dev.runs.filter(function (r) { return r !== run; })), width, top);
    axes(svg, s, top);
    var g = el("g", { "clip-path": clip(svg, "clip-" + run.role + "-" + dev.device) }, svg);
    bands(g, run, s, TOP, HEIGHT - BOTTOM, true);
    if (run.history) {
      svg.setAttribute("data-drawn-max", Math.max.apply(null, run.history.totals.concat([0])));
      stacked(g, run, s);
    } else {
      el("text", { x: LEFT + 10, y: TOP + 20 }, svg, run.role + ": no history stored (a summary or baseline); peak " +
        fmtBytes(run.peak_bytes));
    }
    peakMarker(svg, run, s);
    el("text", { x: LEFT + 4, y: 12, "class": "run-label" }, svg, run.role + " · " + run.label);
    hover(svg, [run], s, pointTable);
    return svg;
  }

  function overlay(host, dev, top, width) {
    var svg = el("svg", { "class": "timeline overlay", viewBox: "0 0 " + width + " " + HEIGHT, tabindex: "0",
      "data-device": dev.device, role: "img", "aria-label": "both runs' totals overlaid" }, host);
    var s = scales(dev.runs, width, top);
    axes(svg, s, top);
    var g = el("g", { "clip-path": clip(svg, "clip-overlay-" + dev.device) }, svg);
    dev.runs.forEach(function (run) {
      if (!run.history) return;
      var pts = run.history.totals.map(function (b, k) { return s.x(pointPos(run, k)).toFixed(1) + "," + s.y(b).toFixed(1); });
      el("path", { "class": "total-line " + run.role, d: "M" + pts.join("L") }, g);
    });
    dev.runs.forEach(function (run) { peakMarker(svg, run, s); });
    hover(svg, dev.runs, s, function (r, k) {
      return [[r.role + " event " + r.history.events[k].toLocaleString(), fmtBytes(r.history.totals[k])]];
    });
    return svg;
  }

  // The groups live at the peak, one lane each: its site (cut to fit) and bytes above its
  // allocations' bars. Lanes follow the page's category order, largest group first within one.
  function bars(host, dev, run, width) {
    var lanes = [], seen = {};
    (run.bars || []).forEach(function (b) { if (!(b.signature in seen)) { seen[b.signature] = lanes.length; lanes.push(b.signature); } });
    if (!lanes.length) return null;
    var rank = function (sig) { var c = (run.groups[sig] || {}).category || "other"; return ORDER.indexOf(c); };
    var first = {};
    lanes.forEach(function (sig, i) { first[sig] = i; });
    lanes.sort(function (a, b) { return rank(a) - rank(b) || first[a] - first[b]; });
    lanes.forEach(function (sig, i) { seen[sig] = i; });
    var height = TOP + lanes.length * LANE + 6;
    var svg = el("svg", { "class": "bars", viewBox: "0 0 " + width + " " + height, "data-role": run.role,
      "data-device": dev.device }, host);
    var s = scales(dev.runs, width, 1);
    var g = el("g", { "clip-path": clip(svg, "clip-bars-" + run.role + "-" + dev.device) }, svg);
    bands(g, run, s, TOP, TOP + lanes.length * LANE, false);
    var labels = el("g", { "class": "lane-labels" }, svg);
    lanes.forEach(function (sig, i) {
      var grp = run.groups[sig] || {}, y = TOP + i * LANE + 10;
      el("text", { x: LEFT - 4, y: y, "text-anchor": "end", "class": "lane-label" }, labels, fmtBytes(grp.bytes || 0));
      var lane = el("g", {}, labels);  // the full site on hover, also where the label is cut
      el("title", {}, lane, (grp.site || "") + " (" + (grp.category || "other") + ")");
      fitText(el("text", { x: LEFT + 3, y: y, "class": "bar-label", "data-signature": sig,
        "data-category": grp.category || "other" }, lane), grp.site || "", s.w - 6);
    });
    run.bars.forEach(function (b) {
      var grp = run.groups[b.signature] || {};
      var a = s.x(b.start_event < 0 ? 0 : eventPos(run, b.start_event)), z = s.x(eventPos(run, Math.min(b.end_event, run.trace_events - 1)));
      var r = el("rect", { "class": "bar", x: a, y: TOP + seen[b.signature] * LANE + 12, width: Math.max(1.5, z - a),
        height: LANE - 15, fill: color(grp.category || "other"), "data-signature": b.signature }, g);
      r.addEventListener("mouseenter", function (ev) {
        showTip(ev, [[[grp.site || "", fmtBytes(b.bytes)], ["category", grp.category || ""],
          ["group", fmtBytes(grp.bytes || 0) + " in " + (grp.count || 0).toLocaleString() + " allocations"]]]);
        showGroup(run, b.signature);
      });
      r.addEventListener("mouseleave", hideTip);
    });
    el("text", { x: LEFT + 4, y: 12 }, svg, run.role + ": largest groups live at the peak by category, " +
      "each allocation from its allocation to its free");
    applySelection(svg);
    return svg;
  }

  function stackBlock(title, frames) {
    var h = document.createElement("div");
    h.textContent = title;
    var pre = document.createElement("pre");
    pre.textContent = frames.join("\n");
    detail.appendChild(h); detail.appendChild(pre);
  }

  function showGroup(run, sig) {
    var grp = run.groups[sig];
    if (!grp) return;
    detail.textContent = "";
    var head = document.createElement("strong");
    head.textContent = run.role + ": " + grp.site + " (" + grp.category + "), " + fmtBytes(grp.bytes) + " in " +
      grp.count.toLocaleString() + " allocations";
    detail.appendChild(head);
    stackBlock("", grp.stack);
  }

  function showRow(row) {
    detail.textContent = "";
    var head = document.createElement("strong");
    head.textContent = row.title;
    detail.appendChild(head);
    row.stacks.forEach(function (m) {
      stackBlock(m.side + ": " + m.count.toLocaleString() + " allocations, " + fmtBytes(m.bytes), m.frames);
    });
  }

  function applySelection(svg) {
    var sigs = state.selected;
    svg.classList.toggle("dim", !!sigs);
    svg.querySelectorAll("rect.bar").forEach(function (r) {
      r.classList.toggle("hl", !!sigs && sigs.indexOf(r.getAttribute("data-signature")) >= 0);
    });
  }

  function drawDevice(dev, section) {
    var host = section.querySelector(".charts"), barHost = section.querySelector(".bar-charts");
    var width = Math.max(640, Math.min(1200, host.clientWidth || 1000));
    var top = 1;
    dev.runs.forEach(function (r) {
      top = Math.max(top, r.peak_bytes);
      if (r.history) top = Math.max(top, Math.max.apply(null, r.history.totals.concat([0])));
    });
    top *= 1.08;
    host.textContent = ""; barHost.textContent = "";
    if (state.overlay && dev.runs.length > 1) overlay(host, dev, top, width);
    else dev.runs.forEach(function (run) { timeline(host, dev, run, top, width); });
    dev.runs.forEach(function (run) { bars(barHost, dev, run, width); });
    host.querySelectorAll("svg").forEach(function (svg) { svg.addEventListener("wheel", wheel, { passive: false }); svg.addEventListener("keydown", keys); drag(svg); });
  }

  function zoomTo(x0, x1) {
    var span = Math.min(1, Math.max(1e-4, x1 - x0));
    x0 = Math.min(Math.max(0, x0), 1 - span);
    state.x0 = x0; state.x1 = x0 + span;
    redrawAll();
  }

  function zoomBy(factor, at) {
    var span = state.x1 - state.x0, c = state.x0 + at * span;
    zoomTo(c - at * span * factor, c - at * span * factor + span * factor);
  }

  function wheel(ev) {
    ev.preventDefault();
    var box = ev.currentTarget.getBoundingClientRect();
    var at = Math.min(1, Math.max(0, (ev.clientX - box.left - LEFT * box.width / ev.currentTarget.viewBox.baseVal.width) /
      (box.width * (1 - (LEFT + RIGHT) / ev.currentTarget.viewBox.baseVal.width))));
    zoomBy(ev.deltaY > 0 ? 1.25 : 0.8, at);
  }

  function keys(ev) {
    var span = state.x1 - state.x0;
    if (ev.key === "+" || ev.key === "=") zoomBy(0.8, 0.5);
    else if (ev.key === "-") zoomBy(1.25, 0.5);
    else if (ev.key === "ArrowLeft") zoomTo(state.x0 - span * 0.1, state.x1 - span * 0.1);
    else if (ev.key === "ArrowRight") zoomTo(state.x0 + span * 0.1, state.x1 + span * 0.1);
    else if (ev.key === "0") zoomTo(0, 1);
    else return;
    ev.preventDefault();
  }

  function drag(svg) {
    var start = null;
    svg.addEventListener("mousedown", function (ev) { start = { x: ev.clientX, x0: state.x0, x1: state.x1 }; });
    window.addEventListener("mouseup", function () { start = null; });
    svg.addEventListener("mousemove", function (ev) {
      if (!start || !(ev.buttons & 1)) return;
      var box = svg.getBoundingClientRect(), span = start.x1 - start.x0;
      var moved = (ev.clientX - start.x) / box.width * span;
      if (Math.abs(moved) > 0) zoomTo(start.x0 - moved, start.x1 - moved);
    });
  }

  function redrawAll() { redraws.forEach(function (f) { f(); }); }

  function toolbar() {
    var bar = document.getElementById("toolbar");
    if (!bar) return;
    var timeButton = bar.querySelector("[data-action=time]"), overlayButton = bar.querySelector("[data-action=overlay]");
    var allTimed = data.devices.every(function (d) { return d.runs.every(hasTime); });
    if (timeButton) {
      timeButton.disabled = !allTimed;
      if (!allTimed) timeButton.title = "a run has no time_us on its trace entries";
      timeButton.addEventListener("click", function () {
        state.time = !state.time; timeButton.setAttribute("aria-pressed", state.time); redrawAll();
      });
    }
    if (overlayButton) overlayButton.addEventListener("click", function () {
      state.overlay = !state.overlay; overlayButton.setAttribute("aria-pressed", state.overlay); redrawAll();
    });
    var reset = bar.querySelector("[data-action=reset]");
    if (reset) reset.addEventListener("click", function () { zoomTo(0, 1); });
  }

  function rows() {
    document.querySelectorAll("tr.row").forEach(function (tr) {
      var dev = data.devices.filter(function (d) { return String(d.device) === tr.getAttribute("data-device"); })[0];
      var row = dev && dev.rows[tr.getAttribute("data-row")];
      if (!row) return;
      var show = function () { showRow(row); };
      tr.addEventListener("mouseenter", show);
      tr.addEventListener("focus", show);
      var select = function () {
        var same = state.selected === row.signatures;
        document.querySelectorAll("tr.row.selected").forEach(function (o) { o.classList.remove("selected"); });
        state.selected = same ? null : row.signatures;
        if (!same) tr.classList.add("selected");
        detail.classList.toggle("pinned", !same);
        document.querySelectorAll("svg.bars").forEach(applySelection);
        showRow(row);
      };
      tr.addEventListener("click", select);
      tr.addEventListener("keydown", function (ev) { if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); select(); } });
    });
  }

  // What the colours mean, readable without hovering: the categories in the page's order (the
  // stacks' bottom first) and the phase shading of the bands drawn.
  function legend() {
    var phases = {};
    data.devices.forEach(function (d) { d.runs.forEach(function (r) {
      (r.bands || []).forEach(function (b) { phases[b.phase] = 1; });
    }); });
    var phaseOrder = PHASES.filter(function (p) { return p in phases; })
      .concat(Object.keys(phases).filter(function (p) { return PHASES.indexOf(p) < 0; }).sort());
    document.querySelectorAll(".legend").forEach(function (host) {
      host.textContent = "";
      var entry = function (row, key, name, text) {
        var span = document.createElement("span"), sw = document.createElement("i");
        span.setAttribute(key, name);
        row.appendChild(span); span.appendChild(sw); span.appendChild(document.createTextNode(text));
        return sw;
      };
      var row = function (cls, title) {
        var div = document.createElement("div"), b = document.createElement("b");
        div.className = "legend-row " + cls; b.textContent = title;
        div.appendChild(b); host.appendChild(div);
        return div;
      };
      if (ORDER.length) {
        var cats = row("categories", "categories, stacked from the bottom:");
        ORDER.forEach(function (c) { entry(cats, "data-category", c, c).style.background = color(c); });
      }
      if (phaseOrder.length) {
        var ph = row("phases", "phases, shaded behind the charts:");
        phaseOrder.forEach(function (p) {
          entry(ph, "data-phase", p, p === "other" ? "other (not shaded)" : p).className = "band-" + p;
        });
      }
    });
  }

  data.devices.forEach(function (dev) {
    var section = document.querySelector("section.device[data-device='" + dev.device + "']");
    if (!section) return;
    var draw = function () { drawDevice(dev, section); };
    redraws.push(draw);
  });
  toolbar();
  legend();
  rows();
  redrawAll();
  window.addEventListener("resize", redrawAll);
  document.body.setAttribute("data-drawn", "true");
})();
