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
	// ErrLockLost: a hold ended without an Unlock (renewal found the lock gone, the
	// lease could have expired before a renewal succeeded, a force-release). An
	// Unlock of such a hold returns an error matching both it and ErrNotHeld.
	ErrLockLost = errors.New("leash: lock lost")
	// ErrInvalidArgument: input that cannot work (empty name, negative duration, nil
	// context, one lock name used as both Mutex and FairMutex in one client).
	ErrInvalidArgument = errors.New("leash: invalid argument")
)

// errHoldLost answers an Unlock of a hold that was lost (the lease ran out, a
// renewal or the Unlock itself found the owner's field gone, a force-release): it
// matches both ErrNotHeld and ErrLockLost.
var errHoldLost error = holdLostError{}

type holdLostError struct{}

func (holdLostError) Error() string { return "leash: lock not held by this owner: the hold was lost" }

func (holdLostError) Is(target error) bool { return target == ErrNotHeld || target == ErrLockLost }

// errKindMismatch: one client uses a lock name with both protocols.
var errKindMismatch = fmt.Errorf("%w: the lock is in use as the other kind (Mutex vs FairMutex) in this client", ErrInvalidArgument)

// WrapError adds the lock's name to err. Context errors pass through unchanged, so
// err == ctx.Err() holds for a caller whose context ended; nil stays nil. Sentinels
// stay matchable with errors.Is, and so do wrapped Redis errors.
func WrapError(lock string, err error) error {
	switch err {
	case nil, context.Canceled, context.DeadlineExceeded:
		return err
	case ErrNotHeld, ErrClosed, ErrNotAcquired, ErrLockLost, errKindMismatch, errHoldLost:
		return fmt.Errorf("%w (lock %q)", err, lock)
	default:
		return fmt.Errorf("leash: lock %q: %w", lock, err)
	}
}
