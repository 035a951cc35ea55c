'use strict'
// nsqjs: PUB, MPUB and DPUB from a Writer, then a Reader that FINs, REQs (with and
// without delay) and sees the redeliveries; optional snappy or deflate on both.
// Usage: node nsqjs_roundtrip.js HOST:PORT TOPIC CHANNEL [none|snappy|deflate]

const nsq = require('nsqjs')
const {version} = require('nsqjs/package.json')
const {Scenario, parseArgs, DEFER_MS, REQUEUE_DELAY_MS} = require('./scenario')

const args = parseArgs()
const options = {snappy: args.compression === 'snappy', deflate: args.compression === 'deflate'}
const scenario = new Scenario('nsqjs', version)

function negotiated (conn) {
  const r = conn && conn.statemachine && conn.statemachine.identifyResponse
  return r ? {snappy: Boolean(r.snappy), deflate: Boolean(r.deflate), version: r.version} : null
}

function call (fn) {
  return new Promise((resolve, reject) => fn((err) => (err ? reject(err) : resolve())))
}

const writer = new nsq.Writer(args.host, args.port, options)
writer.on('error', (err) => scenario.fail(err))
writer.on('ready', async () => {
  try {
    scenario.result.negotiated.writer = negotiated(writer.conn)
    await call((cb) => writer.publish(args.topic, 'pub-1', cb))
    await call((cb) => writer.publish(args.topic, ['mpub-1', 'mpub-2'], cb))
    scenario.result.deferred_at_ms = scenario.elapsed()
    await call((cb) => writer.deferPublish(args.topic, ['dpub-1'], DEFER_MS, cb))
    consume()
  } catch (err) {
    scenario.fail(err)
  }
})
writer.connect()

function consume () {
  const reader = new nsq.Reader(args.topic, args.channel, {
    nsqdTCPAddresses: [`${args.host}:${args.port}`], maxInFlight: 10, ...options
  })
  const register = reader.registerConnectionListeners.bind(reader)
  reader.registerConnectionListeners = (conn) => {
    conn.on('ready', () => { scenario.result.negotiated.reader = negotiated(conn) })
    register(conn)
  }
  reader.on('error', (err) => scenario.fail(err))
  reader.on('message', (msg) => {
    const action = scenario.decide(msg.body.toString(), msg.attempts)
    if (action === 'requeue-now') msg.requeue(0, false)
    else if (action === 'requeue-later') msg.requeue(REQUEUE_DELAY_MS, false)
    else msg.finish()
  })
  scenario.onDone = () => { reader.close(); writer.close() }
  reader.connect()
}
