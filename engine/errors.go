package engine

import (
	"context"
	"errors"
	"fmt"
)

// The engine's sentinel errors. The public package lockapi re-exports them; their
// text is part of the API.
var (
	// ErrNotHeld: an Unlock by a handle that does not hold the lock, or whose hold
	// was lost (the lease ran out, or the lock was force-released).
	ErrNotHeld = errors.New("leash: lock not held by this owner")
	// ErrClosed: the client was closed before or during the call.
	ErrClosed = errors.New("leash: client closed")
	// ErrNotAcquired: the lock was not acquired within the wait the caller allowed
	// (TryLock turns it into false).
	ErrNotAcquired = errors.New("leash: lock not acquired within the wait")
	// ErrLockLost: a hold ended without an Unlock (renewal found the lock gone, or
	// the lease could have expired before a renewal succeeded).
	ErrLockLost = errors.New("leash: lock lost")
	// ErrInvalidArgument: input that cannot work (empty name, negative duration, nil
	// context, one lock name used as both Mutex and FairMutex in one client).
	ErrInvalidArgument = errors.New("leash: invalid argument")
)

// errKindMismatch: one client uses a lock name with both protocols.
var errKindMismatch = fmt.Errorf("%w: the lock is in use as the other kind (Mutex vs FairMutex) in this client", ErrInvalidArgument)

// WrapError adds the lock's name to err. Context errors pass through unchanged, so
// err == ctx.Err() holds for a caller whose context ended; nil stays nil. Sentinels
// stay matchable with errors.Is, and so do wrapped Redis errors.
func WrapError(lock string, err error) error {
	switch err {
	case nil, context.Canceled, context.DeadlineExceeded:
		return err
	case errKindMismatch:
		return fmt.Errorf("%w (lock %q)", err, lock)
	case ErrNotHeld, ErrClosed, ErrNotAcquired, ErrLockLost:
		return fmt.Errorf("%w (lock %q)", err, lock)
	default:
		return fmt.Errorf("leash: lock %q: %w", lock, err)
	}
}
