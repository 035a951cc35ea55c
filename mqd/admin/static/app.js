/*
 * mqadmin's pages: a small client app over mqadmin's JSON API (nsqadmin's paths and field
 * names, plus mqd's /api/history, /api/health, /api/lookup, /api/peek, /api/snapshot, /api/replay).
 * Plain script, no build step, no framework; charts are the vendored uPlot (static/vendor/).
 *
 * Routing: history API (no hash) on the UI routes, relative to <base href> (--base-path):
 *   ""  "topics"  "topics/:topic"  "topics/:topic/:channel"  "nodes"  "nodes/:node"
 *   "counter"  "lookup".  Links inside the base path are followed without reloading.
 *
 * Test hooks (stable `data-test` attributes; Selenium uses these, not classes or text):
 *   layout     nav-home, nav-streams, nav-nodes, nav-counter, nav-lookup (links); breadcrumbs;
 *              paused-badge (topic and channel titles; hidden unless paused); page (the <main>, with
 *              data-page="streams|topic|channel|nodes|node|counter|lookup|notfound",
 *              data-loaded="true" once its main data arrived, data-refreshes="<n>" counting
 *              completed refreshes); page-title (h2); warning (API "message", e.g. a broker
 *              down: "WARNING: ..."; hidden when empty); error (a failed API call, e.g.
 *              "UPSTREAM_ERROR: ..."; hidden when none)
 *   tables     data-rows="<n>" on the <table> (hidden when 0; a <p> data-test="<table>-empty"
 *              says so instead, e.g. topics-table-empty); rows data-test="row-<key>"; cells
 *              data-test="<field>" with data-value="<raw number>" on numeric cells (the text
 *              has thousands separators). Keys and tables:
 *                topics-table      (streams)  row-<topic>: topic, depth, channel_depth,
 *                                  in_flight_count, deferred_count, message_count, channels,
 *                                  rate, paused
 *                producers-table   (topic, channel) row-<node> per producer and row-total:
 *                                  node, depth, memory_depth, backend_depth, message_count, paused,
 *                                  e2e-p<q> (e.g. e2e-p99; ascending, p50 before p99; empty when
 *                                  the row has no samples); topic page adds channels; channel page
 *                                  adds in_flight_count, deferred_count, requeue_count,
 *                                  timeout_count, connections
 *                channels-table    (topic)    row-<channel>: channel, depth, memory_depth,
 *                                  backend_depth, in_flight_count, deferred_count, requeue_count,
 *                                  timeout_count, message_count, connections, paused, e2e-p<q>
 *                clients-table     (channel, node) row-<remote_address>: client (span
 *                                  client-name: "hostname:port (client_id)" as nsqadmin names it,
 *                                  the details as its title; details client-details with dd
 *                                  detail-<client_id|hostname|remote_address|user_agent|version|
 *                                  tls|compression|sample_rate|authed|connect_ts>), user_agent,
 *                                  attributes (spans attr-tls, attr-deflate, attr-snappy,
 *                                  attr-auth, attr-sampled), node, topic, channel (node page only),
 *                                  ready_count, in_flight_count, finish_count, requeue_count,
 *                                  message_count, connected
 *                nodes-table       (nodes)    row-<broadcast_address:http_port>: node, hostname,
 *                                  broadcast_address, tcp_port, http_port, version, topics,
 *                                  tombstones, health ("up"/"down", and data-up="true|false" on
 *                                  the row), ping, durable ("yes"/"no"; empty unless the broker is
 *                                  an mqd), backend, snapshot (button action-snapshot, mqd only)
 *                node-topics-table (node)     row-<topic>: topic, depth, memory_depth,
 *                                  backend_depth, message_count, channels, paused, tombstone
 *                                  (button action-tombstone)
 *                node-channels-table (node)   row-<topic>/<channel>: topic, channel, depth,
 *                                  memory_depth, backend_depth, in_flight_count, deferred_count,
 *                                  requeue_count, timeout_count, message_count, connections,
 *                                  paused
 *                lookup-table      (lookup, one per lookupd inside section
 *                                  data-test="lookupd-<address>") row-<topic>: topic, channels,
 *                                  producers, delete (button action-delete)
 *                counter-table     (counter)  row-<topic>/<channel>: topic, channel, message_count
 *                peek-table        (channel)  row-<id> (row-<id>@<node> if two brokers share
 *                                  an id): node, id, attempts, age, size, due (deferred_until),
 *                                  timeout (timeout_at), client, body (data-node on the row)
 *                snapshot-queues   (nodes, after a snapshot) row-<queue name>: queue, count,
 *                                  queued, in_flight, deferred
 *   charts     chart-cluster (streams), chart-topic, chart-channel, chart-counter: a <div> with
 *              data-points="<n>" (points drawn, updated on every redraw), data-last="<t>"
 *              (unix s of the newest point), and after each draw data-x-ticks (the time axis'
 *              labels, "|"-separated) and data-scales (JSON {rate|depth|in_flight: [min, max]});
 *              uPlot draws inside it; chart-<name>-status is the caption's note (window and
 *              interval, or why there is no history). Depth: the topic chart's sums the topic's
 *              and its channels' depths, the cluster chart's every topic's and channel's
 *   actions    buttons action-pause, action-unpause (only the one that applies; both when
 *              the producers disagree), action-empty, action-delete (topic and channel pages;
 *              lookup rows), action-tombstone (node-topics rows), action-snapshot
 *              (nodes rows), action-create (lookup form with inputs create-topic,
 *              create-channel). Each opens the confirm dialog:
 *   dialog     confirm-dialog (hidden unless asking), confirm-title, confirm-text (what will
 *              happen, on which brokers), confirm-yes, confirm-no (Escape = no)
 *   results    action-results: data-action="<what>", data-state="pending|done|partial|failed"
 *              (partial: the request succeeded but some target failed; failed: an error answer,
 *              e.g. 403 FORBIDDEN);
 *              action-message (the answer's "message" or the error); one li data-test="result"
 *              per target with data-target="lookupd|nsqd", data-address, data-ok="true|false";
 *              action-results-close
 *   counter    counter-total (data-value), counter-rate (msgs/s, data-value)
 *   node       node-totals with spans total_topics, total_messages, total_clients (data-value)
 *   peek       peek-panel (hidden unless some broker producing the channel is an mqd;
 *              data-loaded="true" and data-state="<state>" once an answer arrived),
 *              peek-state (select queued|in_flight|deferred), peek-n (input), peek-format
 *              (select text|hex; re-renders without fetching), peek-load (button),
 *              peek-nodes (ul; li data-test="peek-node-<node>" data-total="<n>" or data-error),
 *              peek-table; peek never consumes (GET /api/peek only)
 *   retained   (mqd; topic page) retained-panel (hidden unless some producer keeps a retained log
 *              of the topic) with retained-table: row-<node> per broker: node, epoch (a decimal
 *              string), earliest, latest, records (latest - earliest), bytes (data-value: bytes),
 *              oldest_age (data-value: seconds), retention (what the broker keeps: time and/or bytes)
 *   replay     (mqd; channel page) replay-panel (hidden unless some producer keeps the topic's
 *              retained log) with replay-from (datetime-local, the browser's local time),
 *              replay-start (button: confirm dialog, then POST /api/replay/:topic/:channel
 *              {"timestamp": ms} to every producer; results in action-results, each li with
 *              data-start/data-end when the broker answered them), replay-table: row-<node> per
 *              broker running a replay into the channel: node, position, end, remaining, skipped
 *   snapshot   snapshot-result (data-node), snapshot-path, snapshot-total (data-value),
 *              snapshot-queues, snapshot-report (link, when the answer names a report) or
 *              snapshot-command (the spark_bridge analyze command to run)
 *   lookup     lookupd-<address> sections (data-up="true|false") with lookupd-error (hidden
 *              unless down or failing) and lookup-table; lookup-empty (no lookupd configured);
 *              create-form with create-topic, create-channel, action-create
 */
(function () {
  'use strict';

  var TABLE_REFRESH_MS = 3000;
  var CHART_REFRESH_MS = 2000;
  var COUNTER_REFRESH_MS = 1500;

  // ---------------------------------------------------------------- base path, API

  var BASE = (function () {
    var el = document.querySelector('base');
    var href = el ? el.getAttribute('href') : '/';
    if (!href || href.indexOf('{{') >= 0) {
      // Served without the placeholder replaced (a plain file server): assume the root.
      href = '/';
      if (el) el.setAttribute('href', href);
    }
    var path = new URL(href, location.origin).pathname;
    return path.charAt(path.length - 1) === '/' ? path : path + '/';
  })();

  function ApiError(status, message, data) {
    this.name = 'ApiError';
    this.status = status;
    this.message = message;
    this.data = data;
  }
  ApiError.prototype = Object.create(Error.prototype);

  function api(path, options) {
    options = options || {};
    var init = {method: options.method || 'GET', headers: {Accept: 'application/json'}};
    if (options.body !== undefined) {
      init.headers['Content-Type'] = 'application/json';
      init.body = JSON.stringify(options.body);
    }
    return fetch(BASE + path, init).then(function (response) {
      return response.text().then(function (text) {
        var data = null;
        if (text) {
          try { data = JSON.parse(text); } catch (e) { data = {message: text}; }
        }
        if (!response.ok) {
          var message = (data && data.message) || (response.status + ' ' + response.statusText);
          throw new ApiError(response.status, message, data);
        }
        return data;
      });
    });
  }

  function enc(name) { return encodeURIComponent(name); }
  function topicPath(topic) { return 'topics/' + enc(topic); }
  function channelPath(topic, channel) { return topicPath(topic) + '/' + enc(channel); }
  function nodePath(node) { return 'nodes/' + enc(node); }
  function query(params) {
    var parts = [];
    Object.keys(params).forEach(function (k) {
      if (params[k] !== undefined && params[k] !== null) parts.push(enc(k) + '=' + enc(params[k]));
    });
    return parts.length ? '?' + parts.join('&') : '';
  }

  // ---------------------------------------------------------------- DOM and formatting

  function h(tag, attrs) {
    var el = document.createElement(tag);
    if (attrs) {
      Object.keys(attrs).forEach(function (k) {
        var v = attrs[k];
        if (v === undefined || v === null || v === false) return;
        if (k === 'text') el.textContent = v;
        else if (k === 'on') Object.keys(v).forEach(function (ev) { el.addEventListener(ev, v[ev]); });
        else if (k === 'test') el.setAttribute('data-test', v);
        else el.setAttribute(k, v === true ? '' : v);
      });
    }
    for (var i = 2; i < arguments.length; i++) append(el, arguments[i]);
    return el;
  }

  function append(el, child) {
    if (child === undefined || child === null || child === false) return;
    if (Array.isArray(child)) { child.forEach(function (c) { append(el, c); }); return; }
    el.appendChild(typeof child === 'string' || typeof child === 'number' ?
      document.createTextNode(String(child)) : child);
  }

  function link(href, text, test) { return h('a', {href: href, test: test, text: text}); }

  function commafy(n) {
    if (n === undefined || n === null || n === '') return '';
    if (typeof n !== 'number' || !isFinite(n)) return String(n);
    var rounded = Math.round(n) === n ? n : Math.round(n * 10) / 10;
    return rounded.toLocaleString('en-US');
  }

  function nanos(ns) {
    if (ns === undefined || ns === null || !isFinite(ns)) return '';
    if (ns < 1e3) return ns.toFixed(0) + 'ns';
    if (ns < 1e6) return (ns / 1e3).toFixed(1) + 'µs';
    if (ns < 1e9) return (ns / 1e6).toFixed(1) + 'ms';
    return (ns / 1e9).toFixed(2) + 's';
  }

  function seconds(s) {
    if (s === undefined || s === null || !isFinite(s)) return '';
    var neg = s < 0;
    s = Math.abs(s);
    var out;
    if (s < 1) out = (s * 1000).toFixed(0) + 'ms';
    else if (s < 60) out = s.toFixed(1) + 's';
    else {
      var d = Math.floor(s / 86400), hr = Math.floor(s % 86400 / 3600);
      var m = Math.floor(s % 3600 / 60), sec = Math.floor(s % 60);
      out = (d ? d + 'd' : '') + (d || hr ? hr + 'h' : '') + m + 'm' + sec + 's';
    }
    return neg ? '-' + out : out;
  }

  function memoryDepth(row) {
    if (typeof row.memory_depth === 'number') return row.memory_depth;
    if (typeof row.depth === 'number' && typeof row.backend_depth === 'number') {
      return row.depth - row.backend_depth;
    }
    return null;
  }

  function connections(row) {
    if (Array.isArray(row.clients)) return row.clients.length;
    return typeof row.client_count === 'number' ? row.client_count : null;
  }

  function sum(list, fn) {
    return (list || []).reduce(function (n, x) { var v = fn(x); return n + (typeof v === 'number' ? v : 0); }, 0);
  }

  function yesNo(v) { return v === true ? 'yes' : v === false ? 'no' : '?'; }

  // Percentile columns from an aggregated e2e_processing_latency (nsqadmin's shape: per
  // quantile min/max/average/count; a raw nsqd one has quantile/value).
  function quantileKey(q) { return 'e2e-p' + String(Number((q * 100).toFixed(2))); }

  // Ascending (p50 before p99) whatever order the brokers were configured with.
  function quantiles(e2e) {
    var list = e2e && Array.isArray(e2e.percentiles) ? e2e.percentiles : [];
    return list.map(function (p) { return p.quantile; }).filter(function (q) { return typeof q === 'number'; })
      .sort(function (a, b) { return a - b; });
  }

  // null (an empty cell, as nsqadmin shows it) when the row has no samples: nsqd then reports 0s.
  function e2eValue(row, q) {
    var e2e = row && row.e2e_processing_latency;
    var list = e2e && e2e.percentiles;
    if (!Array.isArray(list) || e2e.count === 0) return null;
    for (var i = 0; i < list.length; i++) {
      if (list[i].quantile === q) {
        var v = list[i].average !== undefined ? list[i].average : list[i].value;
        return typeof v === 'number' ? v : null;
      }
    }
    return null;
  }

  function e2eColumns(qs) {
    return qs.map(function (q) {
      return {key: quantileKey(q), label: 'e2e ' + quantileKey(q).slice(4), fmt: nanos,
        value: function (r) { return e2eValue(r, q); }};
    });
  }

  // ---------------------------------------------------------------- notices

  function notice(test, text) {
    var el = document.querySelector('[data-test="' + test + '"]');
    if (!el) return;
    el.textContent = text || '';
    el.hidden = !text;
  }
  function showWarning(message) { notice('warning', message); }
  function showError(error) {
    notice('error', error ? (error.message || String(error)) : '');
  }

  // ---------------------------------------------------------------- tables

  /*
   * A table updated in place: rows are keyed (data-test="row-<key>"), cells hold one field
   * (data-test="<key>"); a refresh changes only the text that changed, so buttons and links in
   * rows stay the same elements between refreshes (and under a test's finger).
   * A column: {key, label, value(row) -> number|string|null, fmt(value)?, cell(td, row)?,
   * sig(row)?}: `cell` renders rich content again only when `sig` changes.
   */
  function Table(test, emptyText) {
    this.test = test;
    this.el = h('table', {test: test, 'data-rows': '0'});
    this.thead = h('thead');
    this.tbody = h('tbody');
    this.el.appendChild(this.thead);
    this.el.appendChild(this.tbody);
    this.empty = h('p', {'class': 'empty', test: test + '-empty', text: emptyText || 'None.', hidden: true});
    this.wrap = h('div', {'class': 'table-wrap'}, this.el, this.empty);
    this.columns = [];
    this.signature = null;
    this.rows = new Map();
  }

  Table.prototype.update = function (columns, rows) {
    var signature = columns.map(function (c) { return c.key; }).join('|');
    if (signature !== this.signature) {
      this.signature = signature;
      this.columns = columns;
      this.thead.replaceChildren(h('tr', null, columns.map(function (c) {
        return h('th', {text: c.label, title: c.title});
      })));
      this.tbody.replaceChildren();
      this.rows = new Map();
    }
    var seen = new Set();
    var previous = null;
    var self = this;
    rows.forEach(function (row) {
      var key = String(row.key);
      seen.add(key);
      var tr = self.rows.get(key);
      if (!tr) {
        tr = h('tr', {test: 'row-' + key});
        self.columns.forEach(function (c) { tr.appendChild(h('td', {test: c.key})); });
        self.rows.set(key, tr);
      }
      var wanted = previous ? previous.nextSibling : self.tbody.firstChild;
      if (wanted !== tr) self.tbody.insertBefore(tr, wanted);
      previous = tr;
      if (row.cls !== undefined) tr.className = row.cls || '';
      if (row.attrs) Object.keys(row.attrs).forEach(function (a) { tr.setAttribute(a, row.attrs[a]); });
      self.columns.forEach(function (c, i) { fillCell(tr.children[i], c, row.data); });
    });
    this.rows.forEach(function (tr, key) {
      if (!seen.has(key)) { tr.remove(); self.rows.delete(key); }
    });
    this.el.setAttribute('data-rows', String(rows.length));
    this.empty.hidden = rows.length > 0;
    this.el.hidden = rows.length === 0;
  };

  function fillCell(td, column, data) {
    if (column.cell) {
      var sig = column.sig ? String(column.sig(data)) : '';
      if (td.getAttribute('data-sig') !== sig || !td.hasAttribute('data-sig')) {
        td.setAttribute('data-sig', sig);
        td.replaceChildren();
        column.cell(td, data);
      }
      return;
    }
    var value = column.value(data);
    var text = column.fmt ? column.fmt(value) : typeof value === 'number' ? commafy(value) :
      value === undefined || value === null ? '' : String(value);
    if (td.textContent !== text) td.textContent = text;
    if (typeof value === 'number') td.setAttribute('data-value', String(value));
    else td.removeAttribute('data-value');
  }

  // ---------------------------------------------------------------- charts

  /* The series a chart can draw. Each has its own y scale and axis, all from zero: in flight (a
     handful) must not share the depth's axis (thousands), where 3 draws as 0. */
  var SERIES = {
    rate: {label: 'rate (msgs/s)', scale: 'rate', axis: 'msgs/s', side: 3, stroke: '#1f77b4', width: 2},
    depth: {label: 'depth', scale: 'depth', axis: 'depth', side: 1, stroke: '#d62728', width: 1.5, counts: true},
    in_flight: {label: 'in flight', scale: 'in_flight', axis: 'in flight', side: 1, stroke: '#2ca02c', width: 1.5, counts: true},
  };

  // Time ticks in whole seconds at least (uPlot would pick 500 ms steps on a short history).
  var TIME_INCRS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];
  // Counts tick on whole numbers.
  var COUNT_INCRS = (function () {
    var out = [];
    for (var p = 1; p <= 1e12; p *= 10) out.push(p, 2 * p, 5 * p);
    return out;
  })();

  function pad2(n) { return (n < 10 ? '0' : '') + n; }

  function timeLabel(t, incr) {
    var d = new Date(t * 1000);
    var hm = pad2(d.getHours()) + ':' + pad2(d.getMinutes());
    return incr >= 60 && d.getSeconds() === 0 ? hm : hm + ':' + pad2(d.getSeconds());
  }

  // From 0 (rates and counts are never negative) to a little above the highest value.
  function zeroBased(u, min, max) {
    var hi = typeof max === 'number' && isFinite(max) && max > 0 ? max * 1.1 : 1;
    return [0, hi];
  }

  /* A uPlot line chart over time, drawn in place as points arrive. `fields`: which of SERIES to
     draw (default all three); `labels`: a label per field replacing SERIES' (e.g. what "depth"
     sums). The x axis spans the first point to the last. */
  function Chart(name, title, fields, labels) {
    this.name = name;
    this.fields = fields || ['rate', 'depth', 'in_flight'];
    this.labels = labels || {};
    this.el = h('div', {'class': 'chart', test: 'chart-' + name, 'data-points': '0', 'data-last': ''});
    this.status = h('span', {'class': 'chart-status', test: 'chart-' + name + '-status'});
    this.wrap = h('figure', {'class': 'chart-box'}, h('figcaption', null, title || '', ' ', this.status), this.el);
    this.plot = null;
    this.xTicks = [];
    this.onResize = this.resize.bind(this);
    window.addEventListener('resize', this.onResize);
  }

  Chart.prototype.width = function () {
    return Math.max(320, (this.wrap.clientWidth || 800) - 16);
  };

  Chart.prototype.resize = function () {
    if (this.plot) this.plot.setSize({width: this.width(), height: 240});
  };

  Chart.prototype.destroy = function () {
    window.removeEventListener('resize', this.onResize);
    if (this.plot) this.plot.destroy();
    this.plot = null;
  };

  /* Test hooks after each draw: data-x-ticks (the time labels, '|'-separated) and
     data-scales (JSON {scale: [min, max]}). */
  Chart.prototype.drawn = function (u) {
    var scales = {};
    this.fields.forEach(function (f) {
      var sc = u.scales[SERIES[f].scale];
      if (sc) scales[SERIES[f].scale] = [sc.min, sc.max];
    });
    this.el.setAttribute('data-x-ticks', this.xTicks.join('|'));
    this.el.setAttribute('data-scales', JSON.stringify(scales));
  };

  Chart.prototype.options = function () {
    var self = this;
    var scales = {x: {time: true, range: function (u, min, max) {
      // One point: a span of a second, not uPlot's default padding in milliseconds.
      return min !== null && min === max ? [min, min + 1] : [min, max];
    }}};
    var axes = [{
      incrs: TIME_INCRS,
      values: function (u, splits, axisIdx, space, incr) {
        self.xTicks = splits.map(function (t) { return timeLabel(t, incr); });
        return self.xTicks;
      },
    }];
    this.fields.forEach(function (f) {
      var s = SERIES[f];
      scales[s.scale] = {range: zeroBased};
      var axis = {scale: s.scale, label: s.axis, side: s.side, size: 60, stroke: s.stroke,
        values: function (u, splits) { return splits.map(commafy); }};
      if (s.counts) axis.incrs = COUNT_INCRS;
      if (axes.length > 1) axis.grid = {show: false};
      axes.push(axis);
    });
    return {
      width: this.width(),
      height: 240,
      scales: scales,
      series: [{}].concat(this.fields.map(function (f) {
        var s = SERIES[f];
        return {label: self.labels[f] || s.label, scale: s.scale, stroke: s.stroke, width: s.width,
          value: function (u, v) { return v === null || v === undefined ? '--' : commafy(v); }};
      })),
      axes: axes,
      legend: {live: true},
      hooks: {draw: [function (u) { self.drawn(u); }]},
    };
  };

  // points: [{t, rate, depth, in_flight}], oldest first.
  Chart.prototype.update = function (points, caption) {
    points = (points || []).filter(function (p) { return typeof p.t === 'number'; });
    var data = [points.map(function (p) { return p.t; })].concat(this.fields.map(function (f) {
      return points.map(function (p) { return typeof p[f] === 'number' ? p[f] : null; });
    }));
    if (caption !== undefined) this.status.textContent = caption;
    if (typeof window.uPlot === 'function') {
      if (!this.plot) this.plot = new window.uPlot(this.options(), data, this.el);
      else this.plot.setData(data);
    }
    this.el.setAttribute('data-points', String(points.length));
    this.el.setAttribute('data-last', points.length ? String(points[points.length - 1].t) : '');
  };

  function historyCaption(data) {
    if (!data) return '';
    var parts = [];
    if (typeof data.window === 'number') parts.push('last ' + seconds(data.window));
    if (typeof data.interval === 'number') parts.push('every ' + seconds(data.interval));
    return parts.length ? '(' + parts.join(', ') + ')' : '';
  }

  // ---------------------------------------------------------------- confirm dialog, results

  var pendingConfirm = null;

  /* Ask before an action; resolves true on "yes". `lines`: strings or nodes, shown as a list. */
  function confirmAction(title, lines) {
    var dialog = document.querySelector('[data-test="confirm-dialog"]');
    var text = dialog.querySelector('[data-test="confirm-text"]');
    dialog.querySelector('[data-test="confirm-title"]').textContent = title;
    text.replaceChildren(h('ul', null, lines.map(function (l) { return h('li', null, l); })));
    if (pendingConfirm) pendingConfirm(false);
    dialog.hidden = false;
    dialog.querySelector('[data-test="confirm-no"]').focus();
    return new Promise(function (resolve) {
      pendingConfirm = function (answer) {
        pendingConfirm = null;
        dialog.hidden = true;
        resolve(answer);
      };
    });
  }

  function wireDialog() {
    var dialog = document.querySelector('[data-test="confirm-dialog"]');
    dialog.querySelector('[data-test="confirm-yes"]').addEventListener('click', function () {
      if (pendingConfirm) pendingConfirm(true);
    });
    dialog.querySelector('[data-test="confirm-no"]').addEventListener('click', function () {
      if (pendingConfirm) pendingConfirm(false);
    });
    document.addEventListener('keydown', function (e) {
      if (e.key === 'Escape' && pendingConfirm) pendingConfirm(false);
    });
  }

  function resultsPanel() { return document.querySelector('[data-test="action-results"]'); }

  function showResults(label, state, message, results) {
    var panel = resultsPanel();
    panel.hidden = false;
    panel.setAttribute('data-action', label);
    panel.setAttribute('data-state', state);
    panel.className = 'results ' + state;
    var close = h('button', {type: 'button', 'class': 'close', test: 'action-results-close', text: '×',
      title: 'Close', on: {click: function () { panel.hidden = true; }}});
    var heading = label + ': ' + ({pending: 'working…', done: 'done', partial: 'done, but not everywhere'}[state] || 'failed');
    var list = h('ul', null, (results || []).map(function (r) {
      var offsets = typeof r.start === 'number' && typeof r.end === 'number';
      return h('li', {test: 'result', 'data-target': r.target || '', 'data-address': r.address || '',
        'data-ok': r.ok ? 'true' : 'false', 'class': r.ok ? 'ok' : 'failed',
        'data-start': offsets ? String(r.start) : null, 'data-end': offsets ? String(r.end) : null},
      (r.ok ? '✔ ' : '✘ ') + (r.target || '') + ' ' + (r.address || ''),
      r.ok ? (offsets ? ': offsets ' + commafy(r.start) + ' to ' + commafy(r.end) : '') : ': ' + (r.error || 'failed'));
    }));
    panel.replaceChildren(close, h('strong', {text: heading}),
      h('div', {test: 'action-message', text: message || ''}), list);
  }

  /* Confirm, run, show each target's outcome; `after(answer)` runs on success. */
  function runAction(spec) {
    return confirmAction(spec.title, spec.lines).then(function (yes) {
      if (!yes) return null;
      showResults(spec.label, 'pending', '', []);
      return api(spec.path, {method: spec.method, body: spec.body}).then(function (answer) {
        var results = answer && Array.isArray(answer.results) ? answer.results : [];
        var failed = results.some(function (r) { return !r.ok; });
        showResults(spec.label, failed ? 'partial' : 'done', (answer && answer.message) || '', results);
        if (spec.after) spec.after(answer);
        return answer;
      }, function (error) {
        var results = error.data && Array.isArray(error.data.results) ? error.data.results : [];
        showResults(spec.label, 'failed', error.message, results);
        return null;
      });
    });
  }

  function actionButton(action, text, handler, cls) {
    return h('button', {type: 'button', test: 'action-' + action, 'class': cls || '', text: text,
      on: {click: handler}});
  }

  // ---------------------------------------------------------------- pages and routing

  /* A page's life: its timers stop when the user goes elsewhere. */
  function Page(name, title) {
    this.name = name;
    this.alive = true;
    this.timers = [];
    this.charts = [];
    this.refreshes = 0;
    this.root = document.getElementById('page');
    this.root.replaceChildren();
    this.root.setAttribute('data-page', name);
    this.root.setAttribute('data-loaded', 'false');
    this.root.setAttribute('data-refreshes', '0');
    document.title = title ? title + ' · mqadmin' : 'mqadmin';
    showWarning('');
    showError(null);
  }

  Page.prototype.add = function () {
    for (var i = 0; i < arguments.length; i++) append(this.root, arguments[i]);
  };

  Page.prototype.stop = function () {
    this.alive = false;
    this.timers.forEach(clearTimeout);
    this.charts.forEach(function (c) { c.destroy(); });
  };

  Page.prototype.chart = function (name, title, fields, labels) {
    var c = new Chart(name, title, fields, labels);
    this.charts.push(c);
    return c;
  };

  /* Run `fn` now and again `ms` after each run ends (never two at once). */
  Page.prototype.poll = function (ms, fn, main) {
    var self = this;
    function tick() {
      if (!self.alive) return;
      Promise.resolve().then(fn).then(function () {
        if (!self.alive || !main) return;
        self.refreshes += 1;
        self.root.setAttribute('data-loaded', 'true');
        self.root.setAttribute('data-refreshes', String(self.refreshes));
        showError(null);
      }, function (error) {
        if (!self.alive) return;
        if (main) showError(error);
        else if (window.console) console.warn('mqadmin:', error.message || error);
      }).then(function () {
        if (self.alive) self.timers.push(setTimeout(tick, ms));
      });
    }
    tick();
  };

  /* Poll /api/history for a chart. */
  Page.prototype.historyChart = function (chart, params) {
    this.poll(CHART_REFRESH_MS, function () {
      return api('api/history' + query(params || {})).then(function (data) {
        chart.update(data && data.points, historyCaption(data));
      }, function (error) {
        chart.status.textContent = '(no history: ' + error.message + ')';
        throw error;
      });
    }, false);
  };

  function title(text) { return h('h2', {test: 'page-title', text: text}); }

  function crumbs(items) {
    return h('nav', {'class': 'crumbs', test: 'breadcrumbs'}, items.map(function (item, i) {
      return [i ? ' / ' : '', item[1] ? link(item[1], item[0]) : h('span', {text: item[0]})];
    }));
  }

  var current = null;

  var ROUTES = [
    [/^$/, streamsPage],
    [/^topics\/?$/, streamsPage],
    [/^topics\/([^/]+)\/?$/, topicPage],
    [/^topics\/([^/]+)\/([^/]+)\/?$/, channelPage],
    [/^nodes\/?$/, nodesPage],
    [/^nodes\/([^/]+)\/?$/, nodePage],
    [/^counter\/?$/, counterPage],
    [/^lookup\/?$/, lookupPage],
  ];

  function relativePath() {
    var path = location.pathname;
    if (path.indexOf(BASE) === 0) return path.slice(BASE.length);
    if (path + '/' === BASE) return '';
    return path.replace(/^\//, '');
  }

  function render() {
    if (current) current.stop();
    var rel = relativePath();
    for (var i = 0; i < ROUTES.length; i++) {
      var m = ROUTES[i][0].exec(rel);
      if (m) {
        var args = m.slice(1).map(function (s) { return decodeURIComponent(s); });
        current = ROUTES[i][1].apply(null, args);
        markNav(rel);
        return;
      }
    }
    current = new Page('notfound', 'Not found');
    current.add(title('Not found'), h('p', null, 'No page at ', h('code', {text: location.pathname}), '. ',
      link('./', 'Streams')));
  }

  function markNav(rel) {
    var section = rel.split('/')[0] || 'streams';
    if (section === 'topics') section = 'streams';
    document.querySelectorAll('header nav a').forEach(function (a) {
      a.classList.toggle('active', a.getAttribute('data-test') === 'nav-' + section);
    });
  }

  function navigate(url) {
    history.pushState(null, '', url);
    render();
    window.scrollTo(0, 0);
  }

  function go(rel) { navigate(BASE + rel); }

  function wireLinks() {
    document.addEventListener('click', function (e) {
      if (e.defaultPrevented || e.button !== 0 || e.metaKey || e.ctrlKey || e.shiftKey || e.altKey) return;
      var a = e.target.closest ? e.target.closest('a') : null;
      if (!a || !a.href || a.target || a.hasAttribute('download') || a.hasAttribute('data-external')) return;
      var url = new URL(a.href, document.baseURI);
      if (url.origin !== location.origin || url.pathname.indexOf(BASE) !== 0 && url.pathname + '/' !== BASE) return;
      var rel = url.pathname.slice(BASE.length);
      if (/^(api|static|config|ping)(\/|$)/.test(rel)) return;
      e.preventDefault();
      navigate(url.pathname + url.search);
    });
    window.addEventListener('popstate', render);
  }

  // ---------------------------------------------------------------- streams

  function streamsPage() {
    var page = new Page('streams', 'Streams');
    var table = new Table('topics-table', 'No topics in the cluster.');
    var chart = page.chart('cluster', 'Cluster: message rate, depth and in flight', null,
      {depth: 'depth (every topic and channel)'});
    page.add(title('Streams'), chart.wrap, h('h3', {text: 'Topics'}), table.wrap);
    var columns = [
      {key: 'topic', label: 'Topic', sig: function (r) { return r.name; },
        cell: function (td, r) { td.appendChild(link(topicPath(r.name), r.name)); }},
      {key: 'depth', label: 'Depth', title: 'at the topic (memory + disk)', value: function (r) { return r.stats.depth; }},
      {key: 'channel_depth', label: 'Channel depth', title: 'summed over its channels',
        value: function (r) { return r.stats.channels ? sum(r.stats.channels, function (c) { return c.depth; }) : null; }},
      {key: 'in_flight_count', label: 'In-Flight',
        value: function (r) { return r.stats.channels ? sum(r.stats.channels, function (c) { return c.in_flight_count; }) : null; }},
      {key: 'deferred_count', label: 'Deferred',
        value: function (r) { return r.stats.channels ? sum(r.stats.channels, function (c) { return c.deferred_count; }) : null; }},
      {key: 'message_count', label: 'Messages', value: function (r) { return r.stats.message_count; }},
      {key: 'channels', label: 'Channels', value: function (r) { return r.stats.channels ? r.stats.channels.length : null; }},
      {key: 'rate', label: 'Rate (msgs/s)', value: function (r) { return r.rate; }},
      {key: 'paused', label: 'Paused', value: function (r) { return r.stats.paused ? 'paused' : ''; }},
    ];
    var rates = {};
    page.poll(TABLE_REFRESH_MS, function () {
      return api('api/topics').then(function (data) {
        var names = (data && data.topics) || [];
        if (!Array.isArray(names)) names = Object.keys(names);
        names = names.slice().sort();
        var warnings = data && data.message ? [data.message] : [];
        return Promise.all(names.map(function (name) {
          var stats = api('api/topics/' + enc(name)).then(function (s) {
            if (s && s.message) warnings.push(s.message);
            return s || {};
          }, function (error) { warnings.push(name + ': ' + error.message); return {}; });
          var rate = api('api/history' + query({topic: name})).then(function (hdata) {
            var pts = (hdata && hdata.points) || [];
            rates[name] = pts.length ? pts[pts.length - 1].rate : null;
          }, function () { rates[name] = null; });
          return Promise.all([stats, rate]).then(function (both) {
            return {key: name, data: {name: name, stats: both[0], rate: rates[name]}};
          });
        })).then(function (rows) {
          if (!page.alive) return;
          table.update(columns, rows);
          showWarning(unique(warnings).join(' '));
        });
      });
    }, true);
    page.historyChart(chart, {});
    return page;
  }

  function unique(list) {
    return list.filter(function (x, i) { return x && list.indexOf(x) === i; });
  }

  // ---------------------------------------------------------------- topic

  function nodeCell(td, r) {
    if (r.node && r.node !== '*') td.appendChild(link(nodePath(r.node), r.hostname ? r.hostname + ' (' + r.node + ')' : r.node));
    else td.textContent = 'Total';
  }

  function producerColumns(kind, qs) {
    var cols = [
      {key: 'node', label: 'Broker', sig: function (r) { return r.node + '|' + r.hostname; }, cell: nodeCell},
      {key: 'depth', label: 'Depth', value: function (r) { return r.depth; }},
      {key: 'memory_depth', label: 'Memory', value: memoryDepth},
      {key: 'backend_depth', label: 'Disk', value: function (r) { return r.backend_depth; }},
    ];
    if (kind === 'channel') {
      cols = cols.concat([
        {key: 'in_flight_count', label: 'In-Flight', value: function (r) { return r.in_flight_count; }},
        {key: 'deferred_count', label: 'Deferred', value: function (r) { return r.deferred_count; }},
        {key: 'requeue_count', label: 'Requeued', value: function (r) { return r.requeue_count; }},
        {key: 'timeout_count', label: 'Timed Out', value: function (r) { return r.timeout_count; }},
      ]);
    }
    cols.push({key: 'message_count', label: 'Messages', value: function (r) { return r.message_count; }});
    if (kind === 'topic') {
      cols.push({key: 'channels', label: 'Channels', value: function (r) { return Array.isArray(r.channels) ? r.channels.length : null; }});
    } else {
      cols.push({key: 'connections', label: 'Connections', value: connections});
    }
    cols.push({key: 'paused', label: 'Paused', value: function (r) { return r.paused ? 'paused' : ''; }});
    return cols.concat(e2eColumns(qs));
  }

  function producerRows(stats) {
    var rows = (stats.nodes || []).map(function (n) { return {key: n.node, data: n}; });
    if (rows.length) rows.push({key: 'total', data: Object.assign({}, stats, {node: '*'}), cls: 'total'});
    return rows;
  }

  function channelColumns(qs) {
    return [
      {key: 'channel', label: 'Channel', sig: function (r) { return r.topic_name + '/' + r.channel_name; },
        cell: function (td, r) { td.appendChild(link(channelPath(r.topic_name, r.channel_name), r.channel_name)); }},
      {key: 'depth', label: 'Depth', value: function (r) { return r.depth; }},
      {key: 'memory_depth', label: 'Memory', value: memoryDepth},
      {key: 'backend_depth', label: 'Disk', value: function (r) { return r.backend_depth; }},
      {key: 'in_flight_count', label: 'In-Flight', value: function (r) { return r.in_flight_count; }},
      {key: 'deferred_count', label: 'Deferred', value: function (r) { return r.deferred_count; }},
      {key: 'requeue_count', label: 'Requeued', value: function (r) { return r.requeue_count; }},
      {key: 'timeout_count', label: 'Timed Out', value: function (r) { return r.timeout_count; }},
      {key: 'message_count', label: 'Messages', value: function (r) { return r.message_count; }},
      {key: 'connections', label: 'Connections', value: connections},
      {key: 'paused', label: 'Paused', value: function (r) { return r.paused ? 'paused' : ''; }},
    ].concat(e2eColumns(qs));
  }

  function producersOf(stats) {
    return (stats && stats.nodes || []).map(function (n) { return n.node; }).filter(Boolean);
  }

  function targetLines(stats) {
    var nodes = producersOf(stats);
    return nodes.length ? 'Brokers producing it (' + nodes.length + '): ' + nodes.join(', ') :
      'No broker produces it now.';
  }

  /* Show Pause or Unpause, whichever applies: Unpause when paused anywhere, Pause while some
     producer (or none known) is not paused; both only when the producers disagree. */
  function showPauseButtons(stats, pause, unpause) {
    var nodes = stats && Array.isArray(stats.nodes) ? stats.nodes : [];
    unpause.hidden = !(stats && stats.paused);
    pause.hidden = !(nodes.length ? nodes.some(function (n) { return !n.paused; }) : !(stats && stats.paused));
  }

  function pausedBadge(stats) {
    return h('span', {'class': 'badge', test: 'paused-badge', hidden: !(stats && stats.paused), text: 'paused'});
  }

  function topicPage(topic) {
    var page = new Page('topic', topic);
    var stats = null;
    var producers = new Table('producers-table', 'No broker produces this topic.');
    var channels = new Table('channels-table', 'No channels: messages queue at the topic until a channel is created.');
    var chart = page.chart('topic', 'Topic ' + topic + ': message rate, depth (the topic and its channels) and in flight',
      null, {depth: 'depth (topic + channels)'});
    var badge = pausedBadge(null);
    function act(action, label, lines, method, after) {
      return function () {
        runAction({label: label, title: label + '?', lines: [lines, targetLines(stats)],
          method: method || 'POST', path: 'api/topics/' + enc(topic),
          body: method === 'DELETE' ? undefined : {action: action}, after: after});
      };
    }
    var pause = actionButton('pause', 'Pause topic', act('pause', 'Pause topic ' + topic,
      'Pause topic ' + topic + ' on every broker producing it: messages stop flowing to its channels (publishing still works).'));
    var unpause = actionButton('unpause', 'Unpause topic', act('unpause', 'Unpause topic ' + topic,
      'Unpause topic ' + topic + ' on every broker producing it.'));
    pause.hidden = unpause.hidden = true;
    var retainedLog = retainedPanel();
    page.add(
      crumbs([['Streams', './'], [topic]]),
      h('h2', {test: 'page-title'}, 'Topic ', h('strong', {text: topic}), ' ', badge),
      h('div', {'class': 'actions'}, pause, unpause,
        actionButton('empty', 'Empty topic queue', act('empty', 'Empty topic ' + topic,
          'Empty topic ' + topic + "'s own queue (messages not yet copied to channels) on every broker producing it; those messages are lost."), 'warn'),
        actionButton('delete', 'Delete topic', act('delete', 'Delete topic ' + topic,
          'Delete topic ' + topic + ' and all its channels: first from every lookupd (so it stays deleted), then on every broker producing it. Its messages are lost.',
          'DELETE', function () { go(''); }), 'danger')),
      chart.wrap,
      h('h3', {text: 'Producers'}), producers.wrap,
      retainedLog.panel,
      h('h3', {text: 'Channels'}), channels.wrap);
    page.poll(TABLE_REFRESH_MS, function () {
      return api('api/topics/' + enc(topic)).then(function (data) {
        if (!page.alive) return;
        stats = data || {};
        var qs = quantiles(stats.e2e_processing_latency);
        producers.update(producerColumns('topic', qs), producerRows(stats));
        retainedLog.update(stats);
        var chanList = (stats.channels || []).slice().sort(function (a, b) {
          return a.channel_name < b.channel_name ? -1 : a.channel_name > b.channel_name ? 1 : 0;
        });
        var cqs = [];
        chanList.forEach(function (c) { quantiles(c.e2e_processing_latency).forEach(function (q) { if (cqs.indexOf(q) < 0) cqs.push(q); }); });
        cqs.sort(function (a, b) { return a - b; });
        channels.update(channelColumns(cqs), chanList.map(function (c) {
          return {key: c.channel_name, data: Object.assign({topic_name: topic}, c)};
        }));
        badge.hidden = !stats.paused;
        showPauseButtons(stats, pause, unpause);
        showWarning(stats.message || '');
      });
    }, true);
    page.historyChart(chart, {topic: topic});
    return page;
  }

  // ---------------------------------------------------------------- channel

  function attributes(td, c) {
    var spans = [];
    if (c.sample_rate) spans.push(h('span', {'class': 'attr', test: 'attr-sampled', text: 'Sampled ' + c.sample_rate + '%'}));
    if (c.tls) {
      spans.push(h('span', {'class': 'attr tls', test: 'attr-tls', text: 'TLS' + (c.tls_version ? ' ' + c.tls_version : ''),
        title: tlsText(c)}));
    }
    if (c.deflate) spans.push(h('span', {'class': 'attr', test: 'attr-deflate', text: 'Deflate'}));
    if (c.snappy) spans.push(h('span', {'class': 'attr', test: 'attr-snappy', text: 'Snappy'}));
    if (c.authed) {
      var label = 'Authed' + (c.auth_identity ? ': ' + c.auth_identity : '');
      spans.push(c.auth_identity_url ?
        h('a', {'class': 'attr auth', test: 'attr-auth', href: c.auth_identity_url, 'data-external': true, text: label}) :
        h('span', {'class': 'attr auth', test: 'attr-auth', text: label}));
    }
    spans.forEach(function (s, i) { if (i) td.appendChild(document.createTextNode(' ')); td.appendChild(s); });
  }

  function attributesSig(c) {
    return [c.sample_rate, c.tls, c.tls_version, c.tls_cipher_suite, c.deflate, c.snappy, c.authed,
      c.auth_identity, c.auth_identity_url].join('|');
  }

  /* nsqadmin's name for a client: hostname:port (port of its remote address), then
     " (client_id)" unless the id is the hostname or its first label. */
  function clientName(c) {
    var hostname = c.hostname || '', id = c.client_id || '';
    var port = (c.remote_address || '').split(':').pop();
    var short = hostname.split('.')[0].toLowerCase();
    var showId = id && id.toLowerCase() !== short && id.toLowerCase() !== hostname.toLowerCase();
    return (hostname || c.remote_address || '') + (hostname && port ? ':' + port : '') + (showId ? ' (' + id + ')' : '');
  }

  // "mutual" qualifies a negotiated (ALPN) protocol; Go reports it true even when none was.
  function tlsText(c) {
    if (!c.tls) return 'no';
    var protocol = c.tls_negotiated_protocol ?
      c.tls_negotiated_protocol + (c.tls_negotiated_protocol_is_mutual ? ' (mutual)' : '') : '';
    return [c.tls_version, c.tls_cipher_suite, protocol].filter(Boolean).join(' ') || 'yes';
  }

  // Everything /stats says about who a client is and how it talks: [[label, data-test suffix, text]].
  function clientDetails(c) {
    return [
      ['Client ID', 'client_id', c.client_id || ''],
      ['Hostname', 'hostname', c.hostname || ''],
      ['Remote address', 'remote_address', c.remote_address || ''],
      ['User-Agent', 'user_agent', c.user_agent || ''],
      ['Protocol', 'version', c.version || ''],
      ['TLS', 'tls', tlsText(c)],
      ['Compression', 'compression', c.snappy ? 'snappy' : c.deflate ? 'deflate' : 'none'],
      ['Sample rate', 'sample_rate', c.sample_rate ? c.sample_rate + '%' : 'none (every message)'],
      ['Authed', 'authed', c.authed ? 'yes' + (c.auth_identity ? ': ' + c.auth_identity : '') +
        (c.auth_identity_url ? ' (' + c.auth_identity_url + ')' : '') : 'no'],
      ['Connected since', 'connect_ts', typeof c.connect_ts === 'number' && c.connect_ts > 0 ?
        new Date(c.connect_ts * 1000).toLocaleString() : ''],
    ];
  }

  /* The client cell: its name (the details as a tooltip) and a disclosure with the same details. */
  function clientCell(td, c) {
    var details = clientDetails(c);
    td.appendChild(h('span', {'class': 'client-name', test: 'client-name', text: clientName(c),
      title: details.filter(function (d) { return d[2]; }).map(function (d) { return d[0] + ': ' + d[2]; }).join('\n')}));
    td.appendChild(h('details', {'class': 'client-details', test: 'client-details'},
      h('summary', {text: 'details'}),
      h('dl', null, details.map(function (d) {
        return [h('dt', {text: d[0]}), h('dd', {test: 'detail-' + d[1], text: d[2]})];
      }))));
  }

  function clientSig(c) {
    return clientDetails(c).map(function (d) { return d[2]; }).join('|');
  }

  function clientColumns(withQueue) {
    var cols = [
      {key: 'client', label: 'Client Host', sig: clientSig, cell: clientCell},
      {key: 'user_agent', label: 'User-Agent', value: function (c) { return c.user_agent || ''; }},
      {key: 'attributes', label: 'Attributes', sig: attributesSig, cell: attributes},
      {key: 'node', label: 'Broker', sig: function (c) { return c.node || ''; },
        cell: function (td, c) { if (c.node) td.appendChild(link(nodePath(c.node), c.node)); }},
    ];
    if (withQueue) {
      cols.push({key: 'topic', label: 'Topic', value: function (c) { return c.topic_name; }});
      cols.push({key: 'channel', label: 'Channel', value: function (c) { return c.channel_name; }});
    }
    return cols.concat([
      {key: 'ready_count', label: 'RDY', value: function (c) { return c.ready_count; }},
      {key: 'in_flight_count', label: 'In-Flight', value: function (c) { return c.in_flight_count; }},
      {key: 'finish_count', label: 'Finished', value: function (c) { return c.finish_count; }},
      {key: 'requeue_count', label: 'Requeued', value: function (c) { return c.requeue_count; }},
      {key: 'message_count', label: 'Messages', value: function (c) { return c.message_count; }},
      {key: 'connected', label: 'Connected', fmt: seconds, value: function (c) {
        return typeof c.connect_ts === 'number' && c.connect_ts > 0 ? Math.max(0, Date.now() / 1000 - c.connect_ts) :
          typeof c.connected === 'number' ? c.connected / 1e9 : null;
      }},
    ]);
  }

  function clientRows(clients) {
    return (clients || []).slice().sort(function (a, b) {
      var x = (a.hostname || '') + (a.remote_address || ''), y = (b.hostname || '') + (b.remote_address || '');
      return x < y ? -1 : x > y ? 1 : 0;
    }).map(function (c) { return {key: c.remote_address || c.client_id, data: c}; });
  }

  function channelPage(topic, channel) {
    var page = new Page('channel', topic + '/' + channel);
    var stats = null;
    var producers = new Table('producers-table', 'No broker has this channel.');
    var clients = new Table('clients-table', 'No clients connected to this channel.');
    var chart = page.chart('channel', 'Channel ' + topic + '/' + channel + ': message rate, depth and in flight');
    var badge = pausedBadge(null);
    function act(action, label, lines, method, after) {
      return function () {
        runAction({label: label, title: label + '?', lines: [lines, targetLines(stats)],
          method: method || 'POST', path: 'api/topics/' + enc(topic) + '/' + enc(channel),
          body: method === 'DELETE' ? undefined : {action: action}, after: after});
      };
    }
    var name = topic + '/' + channel;
    var pause = actionButton('pause', 'Pause channel', act('pause', 'Pause channel ' + name,
      'Pause channel ' + name + ' on every broker producing ' + topic + ': no message is delivered to its consumers until unpaused.'));
    var unpause = actionButton('unpause', 'Unpause channel', act('unpause', 'Unpause channel ' + name,
      'Unpause channel ' + name + ' on every broker producing ' + topic + '.'));
    pause.hidden = unpause.hidden = true;
    var peek = peekPanel(topic, channel);
    peek.hidden = true;
    var replay = replayPanel(topic, channel, function () { return stats; });
    var mqdNodes = new MqdNodes();
    page.add(
      crumbs([['Streams', './'], [topic, topicPath(topic)], [channel]]),
      h('h2', {test: 'page-title'}, 'Channel ', h('strong', {text: name}), ' ', badge),
      h('div', {'class': 'actions'}, pause, unpause,
        actionButton('empty', 'Empty channel queue', act('empty', 'Empty channel ' + name,
          'Empty channel ' + name + "'s queue (memory and disk) on every broker producing " + topic + '; those messages are lost.'), 'warn'),
        actionButton('delete', 'Delete channel', act('delete', 'Delete channel ' + name,
          'Delete channel ' + name + ': first from every lookupd, then on every broker producing ' + topic + '. Its messages are lost.',
          'DELETE', function () { go(topicPath(topic)); }), 'danger')),
      chart.wrap,
      h('h3', {text: 'Producers'}), producers.wrap,
      h('h3', {text: 'Client connections'}), clients.wrap,
      replay.panel,
      peek);
    page.poll(TABLE_REFRESH_MS, function () {
      return api('api/topics/' + enc(topic) + '/' + enc(channel)).then(function (data) {
        if (!page.alive) return;
        stats = data || {};
        producers.update(producerColumns('channel', quantiles(stats.e2e_processing_latency)), producerRows(stats));
        clients.update(clientColumns(false), clientRows(stats.clients));
        replay.update(stats);
        badge.hidden = !stats.paused;
        showPauseButtons(stats, pause, unpause);
        // Peek is mqd's: shown when some broker producing the channel is an mqd (nsqd cannot).
        var nodes = producersOf(stats);
        mqdNodes.check(nodes).then(function (known) {
          if (page.alive) peek.hidden = !nodes.some(function (n) { return known.has(n); });
        });
        showWarning(stats.message || '');
      });
    }, true);
    page.historyChart(chart, {topic: topic, channel: channel});
    return page;
  }

  // ---------------------------------------------------------------- retained log and replay (mqd)

  function bytesText(n) {
    if (typeof n !== 'number' || !isFinite(n)) return '';
    var units = ['B', 'kB', 'MB', 'GB', 'TB'];
    var i = 0;
    while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
    return (i ? n.toFixed(1) : String(n)) + ' ' + units[i];
  }

  /* What a broker keeps of a topic: "1d0h0m0s", "10.0 GB", or both ("whichever comes first"). */
  function retentionText(r) {
    if (!r) return '';
    var parts = [];
    if (r.time_ms) parts.push(seconds(r.time_ms / 1000));
    if (r.bytes) parts.push(bytesText(r.bytes));
    return parts.join(' or ') || 'off';
  }

  function keepsLog(stats) {
    return (stats && stats.nodes || []).some(function (n) { return !!n.retention; });
  }

  function retainedPanel() {
    var table = new Table('retained-table', 'No broker keeps a retained log of this topic.');
    function field(name) { return function (r) { return r.retained ? r.retained[name] : null; }; }
    var columns = [
      {key: 'node', label: 'Broker', sig: function (r) { return r.node + '|' + r.hostname; }, cell: nodeCell},
      {key: 'epoch', label: 'Epoch', title: "the log's life: a new one when the topic is deleted and created again",
        value: function (r) { return r.retained ? r.retained.epoch_text : ''; }},
      {key: 'earliest', label: 'Earliest offset', title: 'the oldest record kept', value: field('earliest')},
      {key: 'latest', label: 'Latest offset', title: 'the offset the next message will get', value: field('latest')},
      {key: 'records', label: 'Records', value: function (r) {
        var x = r.retained;
        return x && typeof x.latest === 'number' && typeof x.earliest === 'number' ? x.latest - x.earliest : null;
      }},
      {key: 'bytes', label: 'Retained', fmt: bytesText, value: field('bytes')},
      {key: 'oldest_age', label: 'Oldest record', title: 'how long ago the oldest record kept was published',
        fmt: seconds, value: function (r) {
          var age = r.retained && r.retained.oldest_age_ms;
          return typeof age === 'number' ? age / 1000 : null;
        }},
      {key: 'retention', label: 'Kept for', title: "the broker's retention of this topic (time, bytes, or both)",
        value: function (r) { return retentionText(r.retention); }},
    ];
    var panel = h('section', {'class': 'retained', test: 'retained-panel', hidden: true},
      h('h3', {text: 'Retained log'}), table.wrap);
    return {panel: panel, update: function (stats) {
      var rows = (stats && stats.nodes || []).filter(function (n) { return n.retention || n.retained; })
        .map(function (n) { return {key: n.node, data: n}; });
      table.update(columns, rows);
      panel.hidden = rows.length === 0;
    }};
  }

  function pad(n, width) { var s = String(n); while (s.length < width) s = '0' + s; return s; }

  /* A Date as a datetime-local input's value (the browser's local time, to the second). */
  function localInputValue(d) {
    return d.getFullYear() + '-' + pad(d.getMonth() + 1, 2) + '-' + pad(d.getDate(), 2) + 'T' +
      pad(d.getHours(), 2) + ':' + pad(d.getMinutes(), 2) + ':' + pad(d.getSeconds(), 2);
  }

  function replayPanel(topic, channel, currentStats) {
    var name = topic + '/' + channel;
    var when = h('input', {test: 'replay-from', name: 'replay-from', type: 'datetime-local', step: '1',
      value: localInputValue(new Date(Date.now() - 3600 * 1000))});
    var table = new Table('replay-table', 'No replay is running into this channel.');
    var columns = [
      {key: 'node', label: 'Broker', sig: function (r) { return r.node + '|' + r.hostname; }, cell: nodeCell},
      {key: 'position', label: 'Position', title: 'the next offset the replay queues',
        value: function (r) { return r.replay.position; }},
      {key: 'end', label: 'End', title: 'the replay stops at this offset (the latest when it began)',
        value: function (r) { return r.replay.end; }},
      {key: 'remaining', label: 'Remaining', value: function (r) {
        return typeof r.replay.end === 'number' && typeof r.replay.position === 'number' ?
          Math.max(0, r.replay.end - r.replay.position) : null;
      }},
      {key: 'skipped', label: 'Skipped', title: 'records that expired before the replay reached them',
        value: function (r) { return r.replay.skipped; }},
    ];
    function start() {
      // A datetime-local value without a zone is the browser's local time, as Date reads it.
      var moment = when.value ? new Date(when.value) : null;
      if (!moment || !isFinite(moment.getTime())) {
        showResults('Replay channel ' + name, 'failed', 'Choose the time to replay from.', []);
        return;
      }
      runAction({label: 'Replay channel ' + name, title: 'Replay channel ' + name + '?', method: 'POST',
        path: 'api/replay/' + enc(topic) + '/' + enc(channel), body: {timestamp: moment.getTime()},
        lines: ['Queue into channel ' + name + ' again every message of ' + topic + ' published at or after ' +
          moment.toString() + ' that the retained log still holds: its consumers receive them again ' +
          '(a replay already running into the channel is replaced).', targetLines(currentStats())]});
    }
    var panel = h('section', {'class': 'replay', test: 'replay-panel', hidden: true},
      h('h3', {text: 'Replay from the retained log'}),
      h('div', {'class': 'form-row'}, h('label', null, 'From ', when),
        h('button', {type: 'button', test: 'replay-start', 'class': 'warn', text: 'Replay from…', on: {click: start}})),
      table.wrap);
    return {panel: panel, update: function (stats) {
      panel.hidden = !keepsLog(stats);
      table.update(columns, (stats && stats.nodes || []).filter(function (n) { return !!n.replay; })
        .map(function (n) { return {key: n.node, data: n}; }));
    }};
  }

  // ---------------------------------------------------------------- peek

  function base64Bytes(b64) {
    try {
      var raw = atob(b64 || '');
      var bytes = new Uint8Array(raw.length);
      for (var i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
      return bytes;
    } catch (e) {
      return new Uint8Array(0);
    }
  }

  function hex(bytes, limit) {
    var out = [];
    for (var i = 0; i < Math.min(bytes.length, limit); i++) out.push((bytes[i] < 16 ? '0' : '') + bytes[i].toString(16));
    return out.join(' ') + (bytes.length > limit ? ' …' : '');
  }

  var BODY_LIMIT = 512;
  // Bytes of each body the brokers send (max_body): enough for BODY_LIMIT characters of any UTF-8.
  var PEEK_MAX_BODY = 4 * BODY_LIMIT;

  function bodyText(m, format) {
    var text;
    if (format === 'hex') text = hex(base64Bytes(m.body), BODY_LIMIT);
    else if (m.body_text === null || m.body_text === undefined) text = '(not UTF-8) ' + hex(base64Bytes(m.body), BODY_LIMIT);
    else text = m.body_text.length > BODY_LIMIT ? m.body_text.slice(0, BODY_LIMIT) + ' …' : m.body_text;
    // The broker cut the body (the row's size is the whole body's).
    return m.truncated && text.slice(-2) !== ' …' ? text + ' …' : text;
  }

  function nsToMs(ns) { return typeof ns === 'number' ? ns / 1e6 : null; }

  function peekPanel(topic, channel) {
    var state = h('select', {test: 'peek-state', name: 'state'},
      h('option', {value: 'queued', text: 'queued'}),
      h('option', {value: 'in_flight', text: 'in flight'}),
      h('option', {value: 'deferred', text: 'deferred'}));
    var n = h('input', {test: 'peek-n', name: 'n', type: 'number', min: '1', max: '1000', value: '20'});
    var format = h('select', {test: 'peek-format', name: 'format'},
      h('option', {value: 'text', text: 'body as text'}),
      h('option', {value: 'hex', text: 'body as hex'}));
    var nodes = h('ul', {test: 'peek-nodes', 'class': 'peek-nodes'});
    var table = new Table('peek-table', 'No messages in that state.');
    table.wrap.hidden = true;
    var last = null;
    var fetchedAt = 0;
    var columns = [
      {key: 'node', label: 'Broker', value: function (m) { return m.node; }},
      {key: 'id', label: 'Id', value: function (m) { return m.id; }},
      {key: 'attempts', label: 'Attempts', value: function (m) { return m.attempts; }},
      {key: 'age', label: 'Age', fmt: seconds, value: function (m) {
        var ts = nsToMs(m.timestamp);
        return ts === null ? null : Math.max(0, (fetchedAt - ts) / 1000);
      }},
      {key: 'size', label: 'Size (bytes)', value: function (m) { return m.size; }},
      {key: 'due', label: 'Due in', fmt: seconds, value: function (m) {
        var t = nsToMs(m.deferred_until);
        return t === null ? null : (t - fetchedAt) / 1000;
      }},
      {key: 'timeout', label: 'Times out in', fmt: seconds, value: function (m) {
        var t = nsToMs(m.timeout_at);
        return t === null ? null : (t - fetchedAt) / 1000;
      }},
      {key: 'client', label: 'Held by', value: function (m) { return m.client || ''; }},
      {key: 'body', label: 'Body', sig: function (m) { return m.node + m.id + format.value; },
        cell: function (td, m) { td.appendChild(h('code', {'class': 'body', text: bodyText(m, format.value)})); }},
    ];
    function draw() {
      if (!last) return;
      var rows = [];
      var keys = new Set();
      nodes.replaceChildren();
      (last.nodes || []).forEach(function (answer) {
        var li = h('li', {test: 'peek-node-' + answer.node});
        if (answer.error) {
          li.setAttribute('data-error', answer.error);
          li.className = 'failed';
          li.textContent = answer.node + ': ' + answer.error;
        } else {
          var msgs = answer.messages || [];
          li.setAttribute('data-total', String(answer.total));
          li.textContent = answer.node + ': ' + commafy(answer.total) + ' ' + last.state.replace('_', ' ') +
            ' (showing ' + msgs.length + (answer.more ? ': the broker\'s answer was full' : '') + ')';
          msgs.forEach(function (m) {
            // Ids are unique per broker; two brokers may happen to use the same one.
            var key = keys.has(m.id) ? m.id + '@' + answer.node : m.id;
            keys.add(key);
            rows.push({key: key, data: Object.assign({node: answer.node}, m), attrs: {'data-node': answer.node}});
          });
        }
        nodes.appendChild(li);
      });
      table.update(columns, rows);
      table.wrap.hidden = false;
    }
    function load() {
      var wanted = state.value;
      nodes.replaceChildren(h('li', {text: 'Peeking…'}));
      return api('api/peek/' + enc(topic) + '/' + enc(channel) + query({state: wanted, n: n.value || 20, max_body: PEEK_MAX_BODY})).then(function (data) {
        fetchedAt = Date.now();
        last = Object.assign({state: wanted}, data || {});
        draw();
        panel.setAttribute('data-state', wanted);
        panel.setAttribute('data-loaded', 'true');
      }, function (error) {
        nodes.replaceChildren(h('li', {'class': 'failed', 'data-error': error.message, text: 'Peek failed: ' + error.message}));
      });
    }
    format.addEventListener('change', function () {
      // Rich cells redraw when their signature (which includes the format) changes.
      draw();
    });
    var button = h('button', {type: 'button', test: 'peek-load', text: 'Peek', on: {click: load}});
    var panel = h('section', {'class': 'peek', test: 'peek-panel'},
      h('h3', {text: 'Peek (reads the first messages, never consumes them)'}),
      h('div', {'class': 'form-row'}, h('label', null, 'State ', state), h('label', null, 'First ', n, ' messages'),
        h('label', null, format), button),
      nodes, table.wrap);
    return panel;
  }

  // ---------------------------------------------------------------- nodes

  // A broker's name everywhere in nsqadmin: broadcast_address:http_port (IPv6 bracketed).
  function nodeId(p) {
    if (p.node) return p.node;
    var host = String(p.broadcast_address || p.hostname || '');
    if (host.indexOf(':') >= 0 && host.charAt(0) !== '[') host = '[' + host + ']';
    return host + ':' + p.http_port;
  }

  /* /api/health as a list, whatever its envelope: [{node, up, ping, durable, backend, version, error}]. */
  function healthList(data) {
    var list = null;
    if (Array.isArray(data)) list = data;
    else if (data && typeof data === 'object') {
      list = data.nodes || data.brokers || data.health || data.producers || null;
      if (list && !Array.isArray(list)) list = toList(list);
      if (!list) list = toList(data);
    }
    return (list || []).map(function (x) {
      var status = String(x.status || x.state || '').toLowerCase();
      return {
        node: x.node || x.address || x.http_address || x.broker || x.name,
        up: typeof x.up === 'boolean' ? x.up : status === 'up' || status === 'ok',
        ping: firstOf(x, ['ping', 'ping_text', 'health']),
        durable: x.durable,
        backend: x.backend,
        version: x.version,
        error: x.error,
      };
    }).filter(function (x) { return x.node; });
  }

  /* A broker is an mqd when it answers mqd's own /config/durable or /config/backend: nsqd answers
     both with 400 INVALID_OPTION, so /api/health gives it neither. */
  function isMqd(x) {
    return !!x && (typeof x.durable === 'boolean' || typeof x.backend === 'string' && x.backend !== '');
  }

  /* Which brokers are mqd, from /api/health; asked again only for a broker not known yet, or one
     that was down when asked. check(nodes) resolves to the Set of mqd nodes. */
  function MqdNodes() {
    this.known = new Set();
    this.asked = new Set();
    this.pending = Promise.resolve(this.known);
  }

  MqdNodes.prototype.check = function (nodes) {
    var self = this;
    var fresh = nodes.filter(function (n) { return !self.asked.has(n); });
    if (!fresh.length) return self.pending;
    fresh.forEach(function (n) { self.asked.add(n); });
    self.pending = api('api/health').then(function (d) {
      var up = new Set();
      healthList(d).forEach(function (x) {
        if (isMqd(x)) self.known.add(x.node);
        if (x.up) up.add(x.node);
      });
      fresh.forEach(function (n) { if (!up.has(n)) self.asked.delete(n); });
      return self.known;
    }, function () {
      fresh.forEach(function (n) { self.asked.delete(n); });
      return self.known;
    });
    return self.pending;
  };

  function toList(obj) {
    return Object.keys(obj).filter(function (k) {
      return obj[k] && typeof obj[k] === 'object' && !Array.isArray(obj[k]);
    }).map(function (k) { return Object.assign({node: k}, obj[k]); });
  }

  function firstOf(obj, keys) {
    for (var i = 0; i < keys.length; i++) if (obj[keys[i]] !== undefined && obj[keys[i]] !== null) return obj[keys[i]];
    return null;
  }

  function nodesPage() {
    var page = new Page('nodes', 'Nodes');
    var table = new Table('nodes-table', 'No brokers found.');
    var snapshot = h('section', {'class': 'snapshot', test: 'snapshot-result', hidden: true});
    page.add(title('Brokers'), snapshot, table.wrap);
    function takeSnapshot(node) {
      runAction({label: 'Snapshot of ' + node, title: 'Take a snapshot of ' + node + '?',
        lines: ['Write broker ' + node + "'s whole queue state (memory queues, in flight, deferred, store) to a snapshot under its data path (<data-path>/snapshots/).",
          'The broker keeps serving; it holds its reactor for a moment to capture a consistent cut.',
          'Nothing is consumed or changed.'],
        method: 'POST', path: 'api/snapshot/' + enc(node),
        after: function (answer) { showSnapshot(snapshot, node, answer || {}); }});
    }
    var columns = [
      {key: 'node', label: 'Broker', sig: function (r) { return r.node + '|' + r.known; },
        cell: function (td, r) { td.appendChild(r.known ? link(nodePath(r.node), r.node) : h('span', {text: r.node})); }},
      {key: 'hostname', label: 'Hostname', value: function (r) { return r.p.hostname; }},
      {key: 'broadcast_address', label: 'Broadcast Address', value: function (r) { return r.p.broadcast_address; }},
      {key: 'tcp_port', label: 'TCP Port', fmt: plain, value: function (r) { return r.p.tcp_port; }},
      {key: 'http_port', label: 'HTTP Port', fmt: plain, value: function (r) { return r.p.http_port; }},
      {key: 'version', label: 'Version', value: function (r) { return r.p.version || (r.h && r.h.version); }},
      {key: 'topics', label: 'Topics', value: function (r) { return Array.isArray(r.p.topics) ? r.p.topics.length : null; }},
      {key: 'tombstones', label: 'Tombstoned', sig: function (r) { return tombstoned(r.p).join(','); },
        cell: function (td, r) {
          var list = tombstoned(r.p);
          td.setAttribute('data-value', String(list.length));
          td.textContent = list.length ? list.length + ': ' + list.join(', ') : '0';
        }},
      {key: 'health', label: 'Health', sig: function (r) { return r.h ? String(r.h.up) : '?'; },
        cell: function (td, r) {
          var up = r.h ? r.h.up : null;
          td.appendChild(h('span', {'class': 'health ' + (up === true ? 'up' : up === false ? 'down' : 'unknown'),
            text: up === true ? 'up' : up === false ? 'down' : '?'}));
        }},
      {key: 'ping', label: '/ping', value: function (r) { return r.h ? (r.h.ping !== null ? r.h.ping : r.h.error || '') : ''; }},
      // Durable and Snapshot are mqd's: empty for an nsqd (or a broker not known to be an mqd).
      {key: 'durable', label: 'Durable', value: function (r) { return isMqd(r.h) ? yesNo(r.h.durable) : ''; }},
      {key: 'backend', label: 'Backend', value: function (r) { return r.h && r.h.backend ? r.h.backend : ''; }},
      {key: 'snapshot', label: 'Snapshot', sig: function (r) { return r.node + '|' + isMqd(r.h); },
        cell: function (td, r) {
          if (isMqd(r.h)) td.appendChild(actionButton('snapshot', 'Snapshot', function () { takeSnapshot(r.node); }));
        }},
    ];
    page.poll(TABLE_REFRESH_MS, function () {
      var warnings = [];
      var nodes = api('api/nodes').then(function (d) {
        if (d && d.message) warnings.push(d.message);
        return (d && d.nodes) || [];
      });
      var health = api('api/health').then(function (d) {
        if (d && d.message) warnings.push(d.message);
        return healthList(d);
      }, function (error) { warnings.push('health: ' + error.message); return []; });
      return Promise.all([nodes, health]).then(function (both) {
        if (!page.alive) return;
        var byNode = new Map();
        both[0].forEach(function (p) { byNode.set(nodeId(p), {node: nodeId(p), p: p, h: null, known: true}); });
        both[1].forEach(function (x) {
          var row = byNode.get(x.node);
          if (row) row.h = x;
          else byNode.set(x.node, {node: x.node, p: {}, h: x, known: false});
        });
        var rows = Array.from(byNode.values()).sort(function (a, b) { return a.node < b.node ? -1 : a.node > b.node ? 1 : 0; });
        table.update(columns, rows.map(function (r) {
          return {key: r.node, data: r, cls: r.h && r.h.up === false ? 'down' : '',
            attrs: {'data-up': r.h ? String(r.h.up) : 'unknown'}};
        }));
        showWarning(unique(warnings).join(' '));
      });
    }, true);
    return page;
  }

  function plain(v) { return v === undefined || v === null ? '' : String(v); }

  function tombstoned(p) {
    return (Array.isArray(p.topics) ? p.topics : []).filter(function (t) { return t && t.tombstoned; })
      .map(function (t) { return t.topic; });
  }

  function reportOf(answer) {
    var m = answer.manifest || {};
    return firstOf(answer, ['report_url', 'report']) || firstOf(m, ['report_url', 'report']);
  }

  function showSnapshot(section, node, answer) {
    var manifest = answer.manifest || {};
    var queues = Array.isArray(manifest.queues) ? manifest.queues : [];
    var total = sum(queues, function (q) { return q.count; });
    var qtable = new Table('snapshot-queues', 'The snapshot holds no queues.');
    qtable.update([
      {key: 'queue', label: 'Queue', value: function (q) { return q.channel ? q.topic + '/' + q.channel : q.topic + ' (topic)'; }},
      {key: 'count', label: 'Messages', value: function (q) { return q.count; }},
      {key: 'queued', label: 'Queued', value: function (q) { return q.queued; }},
      {key: 'in_flight', label: 'In flight', value: function (q) { return q.in_flight; }},
      {key: 'deferred', label: 'Deferred', value: function (q) { return q.deferred; }},
    ], queues.map(function (q) { return {key: q.name, data: q}; }));
    var report = reportOf(answer);
    var path = answer.path || '';
    var next = report ?
      h('p', null, 'Spark report: ', h('a', {href: report, test: 'snapshot-report', 'data-external': true, target: '_blank', text: report})) :
      h('p', null, 'Analyse it with Spark (on a host that sees the path): ',
        h('code', {test: 'snapshot-command', text: 'python -m spark_bridge analyze ' + shellQuote(path) + ' --report report.html'}));
    section.setAttribute('data-node', node);
    section.replaceChildren(
      h('h3', {text: 'Snapshot of ' + (answer.node || node)}),
      h('p', null, 'Path: ', h('code', {test: 'snapshot-path', text: path})),
      h('p', null, h('strong', {test: 'snapshot-total', 'data-value': String(total), text: commafy(total)}),
        ' messages in ' + queues.length + ' queues',
        manifest.created_at ? ', taken ' + manifest.created_at : '',
        manifest.backend ? ', backend ' + manifest.backend : '',
        manifest.durable !== undefined && manifest.durable !== null ? ', durable ' + yesNo(manifest.durable) : ''),
      qtable.wrap, next);
    section.hidden = false;
  }

  function shellQuote(s) {
    return /^[\w@%+=:,./-]+$/.test(s) ? s : "'" + String(s).replace(/'/g, "'\\''") + "'";
  }

  // ---------------------------------------------------------------- node

  function nodePage(node) {
    var page = new Page('node', node);
    var topics = new Table('node-topics-table', 'No topics on this broker.');
    var channels = new Table('node-channels-table', 'No channels on this broker.');
    var clients = new Table('clients-table', 'No clients connected to this broker.');
    var totals = h('p', {'class': 'totals', test: 'node-totals'});
    page.add(crumbs([['Nodes', 'nodes'], [node]]), title('Broker ' + node), totals,
      h('h3', {text: 'Topics'}), topics.wrap, h('h3', {text: 'Channels'}), channels.wrap,
      h('h3', {text: 'Clients'}), clients.wrap);
    function tombstone(topic) {
      runAction({label: 'Tombstone ' + topic + ' on ' + node, title: 'Tombstone topic ' + topic + ' on ' + node + '?',
        lines: ['Tombstone broker ' + node + ' for topic ' + topic + ' on every lookupd (consumers stop discovering it there),',
          'then delete topic ' + topic + ' on ' + node + ' (its messages there are lost). Other brokers keep the topic.'],
        method: 'DELETE', path: 'api/nodes/' + enc(node), body: {topic: topic}});
    }
    var topicColumns = [
      {key: 'topic', label: 'Topic', sig: function (t) { return t.topic_name; },
        cell: function (td, t) { td.appendChild(link(topicPath(t.topic_name), t.topic_name)); }},
      {key: 'depth', label: 'Depth', value: function (t) { return t.depth; }},
      {key: 'memory_depth', label: 'Memory', value: memoryDepth},
      {key: 'backend_depth', label: 'Disk', value: function (t) { return t.backend_depth; }},
      {key: 'message_count', label: 'Messages', value: function (t) { return t.message_count; }},
      {key: 'channels', label: 'Channels', value: function (t) { return (t.channels || []).length; }},
      {key: 'paused', label: 'Paused', value: function (t) { return t.paused ? 'paused' : ''; }},
      {key: 'tombstone', label: '', sig: function (t) { return t.topic_name; },
        cell: function (td, t) { td.appendChild(actionButton('tombstone', 'Tombstone', function () { tombstone(t.topic_name); }, 'danger small')); }},
    ];
    var channelCols = [
      {key: 'topic', label: 'Topic', value: function (c) { return c.topic_name; }},
      {key: 'channel', label: 'Channel', sig: function (c) { return c.topic_name + '/' + c.channel_name; },
        cell: function (td, c) { td.appendChild(link(channelPath(c.topic_name, c.channel_name), c.channel_name)); }},
      {key: 'depth', label: 'Depth', value: function (c) { return c.depth; }},
      {key: 'memory_depth', label: 'Memory', value: memoryDepth},
      {key: 'backend_depth', label: 'Disk', value: function (c) { return c.backend_depth; }},
      {key: 'in_flight_count', label: 'In-Flight', value: function (c) { return c.in_flight_count; }},
      {key: 'deferred_count', label: 'Deferred', value: function (c) { return c.deferred_count; }},
      {key: 'requeue_count', label: 'Requeued', value: function (c) { return c.requeue_count; }},
      {key: 'timeout_count', label: 'Timed Out', value: function (c) { return c.timeout_count; }},
      {key: 'message_count', label: 'Messages', value: function (c) { return c.message_count; }},
      {key: 'connections', label: 'Connections', value: connections},
      {key: 'paused', label: 'Paused', value: function (c) { return c.paused ? 'paused' : ''; }},
    ];
    page.poll(TABLE_REFRESH_MS, function () {
      return api('api/nodes/' + enc(node)).then(function (data) {
        if (!page.alive) return;
        data = data || {};
        var list = (data.topics || []).slice().sort(function (a, b) { return a.topic_name < b.topic_name ? -1 : 1; });
        topics.update(topicColumns, list.map(function (t) { return {key: t.topic_name, data: t}; }));
        var chans = [], cls = [];
        list.forEach(function (t) {
          (t.channels || []).forEach(function (c) {
            var row = Object.assign({topic_name: t.topic_name}, c);
            chans.push({key: t.topic_name + '/' + c.channel_name, data: row});
            (c.clients || []).forEach(function (cl) {
              cls.push(Object.assign({node: node, topic_name: t.topic_name, channel_name: c.channel_name}, cl));
            });
          });
        });
        channels.update(channelCols, chans);
        clients.update(clientColumns(true), clientRows(cls));
        totals.replaceChildren(
          h('span', {test: 'total_topics', 'data-value': String(list.length), text: commafy(list.length) + ' topics'}), ', ',
          h('span', {test: 'total_messages', 'data-value': String(data.total_messages), text: commafy(data.total_messages) + ' messages'}), ', ',
          h('span', {test: 'total_clients', 'data-value': String(data.total_clients), text: commafy(data.total_clients) + ' clients'}));
        showWarning(data.message || '');
      });
    }, true);
    return page;
  }

  // ---------------------------------------------------------------- lookup

  /* /api/lookup as [{address, error, topics: [{topic, channels: [..], producers: [..]}]}]. */
  function lookupList(data) {
    var list = null;
    if (Array.isArray(data)) list = data;
    else if (data && typeof data === 'object') {
      list = data.lookupds || data.nsqlookupd || data.lookupd || null;
      if (list && !Array.isArray(list)) list = toList(list);
    }
    return (list || []).map(function (l) {
      var topics = l.topics || [];
      if (!Array.isArray(topics)) {
        topics = Object.keys(topics).map(function (name) {
          var v = topics[name];
          return Array.isArray(v) ? {topic: name, channels: v} : Object.assign({topic: name}, v);
        });
      }
      return {
        address: l.address || l.lookupd || l.node || l.http_address || '',
        up: l.up !== false,
        error: l.error || null,
        topics: topics.map(function (t) {
          if (typeof t === 'string') return {topic: t, channels: [], producers: []};
          return {topic: t.topic || t.topic_name || t.name, channels: t.channels || [], producers: t.producers || []};
        }),
      };
    });
  }

  function producerName(p) {
    if (typeof p === 'string') return p;
    if (p.node) return p.node;
    return (p.broadcast_address || p.hostname || p.remote_address || '?') + (p.http_port ? ':' + p.http_port : '');
  }

  function lookupPage() {
    var page = new Page('lookup', 'Lookup');
    var sections = h('div', {'class': 'lookupds'});
    var topicInput = h('input', {test: 'create-topic', name: 'topic', placeholder: 'topic', required: true,
      pattern: '[.a-zA-Z0-9_\\-]+(#ephemeral)?', maxlength: '64'});
    var channelInput = h('input', {test: 'create-channel', name: 'channel', placeholder: 'channel (optional)',
      pattern: '[.a-zA-Z0-9_\\-]+(#ephemeral)?', maxlength: '64'});
    var form = h('form', {'class': 'create', test: 'create-form'},
      h('h3', {text: 'Create topic / channel'}),
      h('p', {'class': 'hint', text: 'Declares a topic (and channel) on every lookupd before any producer exists, so consumers can find it; a channel is also created on every broker already producing the topic.'}),
      h('div', {'class': 'form-row'}, topicInput, channelInput,
        h('button', {type: 'submit', test: 'action-create', text: 'Create'})));
    form.addEventListener('submit', function (e) {
      e.preventDefault();
      var topic = topicInput.value.trim(), channel = channelInput.value.trim();
      if (!topic) return;
      var body = channel ? {topic: topic, channel: channel} : {topic: topic};
      var what = channel ? 'channel ' + topic + '/' + channel : 'topic ' + topic;
      runAction({label: 'Create ' + what, title: 'Create ' + what + '?',
        lines: ['Create topic ' + topic + (channel ? ' and channel ' + channel : '') + ' on every lookupd.',
          channel ? 'The channel is also created on every broker producing ' + topic + '.' : 'No broker is changed.'],
        method: 'POST', path: 'api/topics', body: body, after: function () { refresh(); }});
    });
    page.add(title('Lookup'), form, sections);
    var tables = new Map();
    function deleteTopic(topic) {
      runAction({label: 'Delete topic ' + topic, title: 'Delete topic ' + topic + '?',
        lines: ['Delete topic ' + topic + ' and its channels from every lookupd first, then on every broker producing it. Its messages are lost.'],
        method: 'DELETE', path: 'api/topics/' + enc(topic), after: function () { refresh(); }});
    }
    var columns = [
      {key: 'topic', label: 'Topic', sig: function (t) { return t.topic; },
        cell: function (td, t) { td.appendChild(link(topicPath(t.topic), t.topic)); }},
      {key: 'channels', label: 'Channels', value: function (t) { return t.channels.join(', '); }},
      {key: 'producers', label: 'Producers', value: function (t) {
        return t.producers.length ? t.producers.map(producerName).join(', ') : '(none)';
      }},
      {key: 'delete', label: '', sig: function (t) { return t.topic; },
        cell: function (td, t) { td.appendChild(actionButton('delete', 'Delete', function () { deleteTopic(t.topic); }, 'danger small')); }},
    ];
    function refresh() {
      return api('api/lookup').then(function (data) {
        if (!page.alive) return;
        var lookupds = lookupList(data);
        var seen = new Set();
        lookupds.forEach(function (l) {
          seen.add(l.address);
          var entry = tables.get(l.address);
          if (!entry) {
            var table = new Table('lookup-table', 'This lookupd holds no topics.');
            var err = h('p', {'class': 'failed', test: 'lookupd-error', hidden: true});
            var section = h('section', {'class': 'lookupd', test: 'lookupd-' + l.address},
              h('h3', {text: 'lookupd ' + l.address}), err, table.wrap);
            entry = {table: table, section: section, err: err};
            tables.set(l.address, entry);
          }
          sections.appendChild(entry.section);
          entry.section.setAttribute('data-up', String(l.up));
          entry.err.hidden = !l.error && l.up;
          entry.err.textContent = l.up ? l.error || '' : 'down' + (l.error ? ': ' + l.error : '');
          entry.table.update(columns, l.topics.slice().sort(function (a, b) { return a.topic < b.topic ? -1 : 1; })
            .map(function (t) { return {key: t.topic, data: t, cls: t.producers.length ? '' : 'no-producer'}; }));
          if (!l.up) entry.table.empty.hidden = true;  // a lookupd that is down holds nothing we know of
        });
        tables.forEach(function (entry, address) {
          if (!seen.has(address)) { entry.section.remove(); tables.delete(address); }
        });
        if (!lookupds.length) sections.replaceChildren(h('p', {'class': 'empty', test: 'lookup-empty', text: 'mqadmin has no lookupd configured.'}));
        else { var stale = sections.querySelector('[data-test="lookup-empty"]'); if (stale) stale.remove(); }
        showWarning((data && data.message) || '');
      });
    }
    page.poll(TABLE_REFRESH_MS, refresh, true);
    return page;
  }

  // ---------------------------------------------------------------- counter

  function counterPage() {
    var page = new Page('counter', 'Counter');
    var total = h('div', {'class': 'counter-total', test: 'counter-total', text: '…'});
    var rate = h('div', {'class': 'counter-rate', test: 'counter-rate', text: ''});
    var chart = page.chart('counter', 'Messages processed per second (measured by this page)', ['rate']);
    var table = new Table('counter-table', 'No channels in the cluster.');
    page.add(title('Messages processed'), h('div', {'class': 'counter'}, total, rate), chart.wrap,
      h('h3', {text: 'Per channel'}), table.wrap);
    var samples = [];   // [{t (s), n}] for the rate
    var points = [];    // chart points
    var columns = [
      {key: 'topic', label: 'Topic', value: function (r) { return r.topic; }},
      {key: 'channel', label: 'Channel', value: function (r) { return r.channel; }},
      {key: 'message_count', label: 'Messages', value: function (r) { return r.message_count; }},
    ];
    page.poll(COUNTER_REFRESH_MS, function () {
      return api('api/counter').then(function (data) {
        if (!page.alive) return;
        var stats = (data && data.stats) || {};
        var values = Array.isArray(stats) ? stats : Object.keys(stats).map(function (k) { return stats[k]; });
        var n = sum(values, function (v) { return v.message_count; });
        var perChannel = new Map();
        values.forEach(function (v) {
          var key = v.topic_name + '/' + v.channel_name;
          var row = perChannel.get(key) || {topic: v.topic_name, channel: v.channel_name, message_count: 0};
          row.message_count += v.message_count || 0;
          perChannel.set(key, row);
        });
        var now = Date.now() / 1000;
        if (samples.length && n < samples[samples.length - 1].n) samples = [];  // a broker restarted
        samples.push({t: now, n: n});
        while (samples.length > 2 && now - samples[0].t > 10) samples.shift();
        var r = samples.length > 1 ? (n - samples[0].n) / (now - samples[0].t) : null;
        total.textContent = commafy(n);
        total.setAttribute('data-value', String(n));
        rate.textContent = r === null ? 'measuring the rate…' : commafy(Math.round(r * 10) / 10) + ' msgs/s';
        rate.setAttribute('data-value', r === null ? '' : String(r));
        if (r !== null) {
          points.push({t: now, rate: r, depth: null, in_flight: null});
          if (points.length > 400) points.shift();
          chart.update(points, '');
        }
        table.update(columns, Array.from(perChannel.keys()).sort().map(function (k) {
          return {key: k, data: perChannel.get(k)};
        }));
        showWarning((data && data.message) || '');
      });
    }, true);
    return page;
  }

  // ---------------------------------------------------------------- start

  function start() {
    wireDialog();
    wireLinks();
    render();
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
})();
