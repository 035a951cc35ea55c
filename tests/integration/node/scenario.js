'use strict'
// The consumer side every Node client script shares: it records each delivery
// (body, attempts, milliseconds since the publishes started), requeues the first
// delivery of `pub-1` at once and of `mpub-1` with REQUEUE_DELAY_MS, finishes
// everything else, and prints one JSON line once all EXPECTED bodies are finished
// (or the deadline passes, with `error` set and exit status 1).

const EXPECTED = ['pub-1', 'mpub-1', 'mpub-2', 'dpub-1']
const DEFER_MS = 500
const REQUEUE_DELAY_MS = 300
const DEADLINE_MS = 15000

class Scenario {
  constructor (client, version) {
    this.result = {
      client, version, defer_ms: DEFER_MS, requeue_delay_ms: REQUEUE_DELAY_MS,
      deliveries: [], finished: [], negotiated: {}
    }
    this.t0 = Date.now()
    this.done = false
    this.onDone = () => {}
    this.timer = setTimeout(() => this.finish('deadline passed before every message was finished'), DEADLINE_MS)
  }

  elapsed () {
    return Date.now() - this.t0
  }

  // -> 'finish' | 'requeue-now' | 'requeue-later' for one delivery.
  decide (body, attempts) {
    this.result.deliveries.push({body, attempts, ms: this.elapsed()})
    if (attempts === 1 && body === 'pub-1') return 'requeue-now'
    if (attempts === 1 && body === 'mpub-1') return 'requeue-later'
    if (!this.result.finished.includes(body)) this.result.finished.push(body)
    if (EXPECTED.every((b) => this.result.finished.includes(b))) setImmediate(() => this.finish())
    return 'finish'
  }

  fail (err) {
    this.finish(String(err && err.stack ? err.stack : err))
  }

  finish (error) {
    if (this.done) return
    this.done = true
    clearTimeout(this.timer)
    if (error) this.result.error = error
    process.stdout.write(JSON.stringify(this.result) + '\n')
    Promise.resolve()
      .then(() => this.onDone())
      .catch(() => {})
      .finally(() => setTimeout(() => process.exit(error ? 1 : 0), 50))
  }
}

function parseArgs () {
  const [address, topic, channel, compression = 'none'] = process.argv.slice(2)
  if (!address || !topic || !channel) {
    process.stderr.write('usage: node SCRIPT HOST:PORT TOPIC CHANNEL [none|snappy|deflate]\n')
    process.exit(2)
  }
  const i = address.lastIndexOf(':')
  return {host: address.slice(0, i), port: Number(address.slice(i + 1)), topic, channel, compression}
}

module.exports = {Scenario, parseArgs, DEFER_MS, REQUEUE_DELAY_MS}
