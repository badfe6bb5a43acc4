package lockapi

import "github.com/leash-go/leash/engine"

// The errors leash returns, matched with errors.Is. They come wrapped with the
// lock's name; context errors are returned unchanged (err == ctx.Err()), and Redis
// errors come wrapped, matchable with errors.Is and errors.As.
var (
	// ErrNotHeld: Unlock by a handle that does not hold the lock, or whose hold was
	// lost (the lease ran out, or the lock was force-released). Redisson throws
	// IllegalMonitorStateException here.
	ErrNotHeld = engine.ErrNotHeld
	// ErrClosed: the client was closed before or during the call.
	ErrClosed = engine.ErrClosed
	// ErrNotAcquired: the lock was not acquired within the wait given by WithWait.
	// TryLock reports it as false with a nil error.
	ErrNotAcquired = engine.ErrNotAcquired
	// ErrLockLost: the hold ended without an Unlock (its lease ran out, a renewal
	// found the lock gone or could not succeed in time, a force-release). Lost() is
	// how a holder learns it at once; an Unlock of such a hold returns an error
	// matching both ErrLockLost and ErrNotHeld.
	ErrLockLost = engine.ErrLockLost
	// ErrInvalidArgument: an empty lock name, a negative duration, a nil context, or
	// Options that cannot work. Nothing is sent to Redis.
	ErrInvalidArgument = engine.ErrInvalidArgument
)
