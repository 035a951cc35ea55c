'use strict'
// squeaky: PUB, MPUB (an array) and DPUB (a delay) from a Publisher, then a
// Subscriber that FINs, REQs (with and without delay) and sees the redeliveries.
// squeaky has no compression. Its MPUB body size counts the message bytes only
// (not the 4-byte count), the case that once broke mqd's MPUB reading.
// Usage: node squeaky_roundtrip.js HOST:PORT TOPIC CHANNEL

const Squeaky = require('squeaky')
const {version} = require('squeaky/package.json')
const {Scenario, parseArgs, DEFER_MS, REQUEUE_DELAY_MS} = require('./scenario')

const args = parseArgs()
const scenario = new Scenario('squeaky', version)
const connection = {host: args.host, port: args.port, maxConnectAttempts: 1}

async function main () {
  const publisher = new Squeaky.Publisher({...connection, autoConnect: false})
  publisher.on('error', (err) => scenario.fail(err))
  await publisher.connect()
  await publisher.publish(args.topic, 'pub-1')
  await publisher.publish(args.topic, ['mpub-1', 'mpub-2'])
  scenario.result.deferred_at_ms = scenario.elapsed()
  await publisher.publish(args.topic, 'dpub-1', DEFER_MS)

  const subscriber = new Squeaky.Subscriber({...connection, topic: args.topic, channel: args.channel, concurrency: 10})
  subscriber.on('error', (err) => scenario.fail(err))
  subscriber.on('message', (msg) => {
    const body = Buffer.isBuffer(msg.body) ? msg.body.toString() : JSON.stringify(msg.body)
    const action = scenario.decide(body, msg.attempts)
    if (action === 'requeue-now') msg.requeue(0)
    else if (action === 'requeue-later') msg.requeue(REQUEUE_DELAY_MS)
    else msg.finish()
  })
  scenario.onDone = () => Promise.all([subscriber.close(), publisher.close()])
}

main().catch((err) => scenario.fail(err))
