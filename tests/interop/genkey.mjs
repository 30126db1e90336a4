// Writes a fresh swarm key file as js-libp2p writes it: `node genkey.mjs FILE`.
import fs from 'node:fs'
import { generateKey } from '@libp2p/pnet'
const k = new Uint8Array(95); generateKey(k); fs.writeFileSync(process.argv[2], k, { mode: 0o600 })
