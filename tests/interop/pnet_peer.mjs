// A js-libp2p peer with @libp2p/pnet: `dial ADDR KEYFILE` (ping ADDR through the private network)
// or `listen KEYFILE` (print its address, then wait for a connection).
import fs from 'node:fs'
import { createLibp2p } from 'libp2p'
import { tcp } from '@libp2p/tcp'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { identify } from '@libp2p/identify'
import { ping } from '@libp2p/ping'
import { preSharedKey } from '@libp2p/pnet'
import { multiaddr } from '@multiformats/multiaddr'

const [mode, a, b] = process.argv.slice(2)
const keyfile = mode === 'dial' ? b : a
const node = await createLibp2p({
  addresses: { listen: mode === 'listen' ? ['/ip4/127.0.0.1/tcp/0'] : [] },
  transports: [tcp()], connectionEncrypters: [noise()], streamMuxers: [yamux()],
  connectionProtector: preSharedKey({ psk: fs.readFileSync(keyfile) }),
  services: { identify: identify(), ping: ping() }
})
if (mode === 'dial') {
  try {
    const rtt = await node.services.ping.ping(multiaddr(a), { signal: AbortSignal.timeout(10000) })
    console.log(JSON.stringify({ ok: true, rtt_ms: rtt, peers: node.getPeers().map(String) }))
  } catch (e) {
    console.log(JSON.stringify({ ok: false, error: String(e) }))
  }
  await node.stop()
  process.exit(0)
} else {
  console.log(JSON.stringify({ addrs: node.getMultiaddrs().map(String) }))
  node.addEventListener('peer:connect', (evt) => console.log(JSON.stringify({ connected: evt.detail.toString() })))
  setTimeout(async () => { await node.stop(); process.exit(0) }, 30000)
}
