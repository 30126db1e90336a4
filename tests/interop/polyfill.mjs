// Node 20 lacks Promise.withResolvers, which js-libp2p 3 uses: loaded with `node --import`.
if (!Promise.withResolvers) {
  Promise.withResolvers = function () { let resolve, reject; const promise = new Promise((res, rej) => { resolve = res; reject = rej }); return { promise, resolve, reject } }
}
