// Package lockapi is leash's public API: distributed locks on Redis with Redisson's
// wire layout, Go's idioms, and one engine per client that owns all lock state (a
// state machine stepped under one mutex by its goroutine, by idle-path callers,
// by the goroutines that send its batched script calls, and by the pub/sub reader
// when a message finds it idle).
//
// A Client holds one connection pool, one pub/sub connection, one engine and one
// timing wheel, however many locks it serves. A lock handle (Client.Mutex) is one
// owner: the same handle re-entering increments the hold count, and any goroutine
// may use it (ownership is not tied to a goroutine).
//
//	m := client.Mutex("orders:42")
//	if err := <-m.Acquire(ctx); err != nil { ... } // or select on it with other channels
//	defer m.Unlock(context.Background())
//
// Without a lease the watchdog renews the lock every WatchdogTimeout/3 for as long
// as it is held; WithLease gives a fixed lease that is never renewed. Either way,
// Lost closes if the hold ends without an Unlock, before the lease could have run
// out on the server.
package lockapi
