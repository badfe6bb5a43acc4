// Package pubsub keeps leash's unlock-channel subscriptions: one subscription per
// channel name for the whole client, on one dedicated rueidis connection (rueidis's
// SetPubSubHooks route, on which channels can be added and removed at any time).
//
// The engine is the registry's only user and owns the reference counting: it
// subscribes a lock's channel when the lock's first local waiter parks and
// unsubscribes it when the last one leaves, never with both in flight at once.
//
// Messages are handed to a callback that runs on rueidis's read goroutine; it must
// not block (the engine's marks "wake pending" and returns). When the connection
// drops, the registry dials a new one, subscribes every live channel again and then
// calls the reconnect callback, because messages published meanwhile are lost: the
// engine answers by retrying the head waiter of every lock, so no wake-up is lost.
package pubsub
