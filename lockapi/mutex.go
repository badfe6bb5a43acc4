package lockapi

import (
	"context"
	"errors"
	"time"

	"github.com/leash-go/leash/engine"
	"github.com/leash-go/leash/futures"
	"github.com/redis/rueidis"
)

// Mutex is a handle on a reentrant distributed lock, laid out in Redis exactly as
// Redisson's RLock, so Go and Java services can share it. A handle is one owner.
// All methods are safe for concurrent use.
type Mutex struct {
	c     *Client
	name  string
	owner uint64
	fair  bool
}

// Name returns the lock's name: the Redis key of its hash.
func (m *Mutex) Name() string { return m.name }

// Acquire asks for the lock and returns at once. The channel carries exactly one
// value and is never closed:
//
//   - nil: the handle holds the lock (again, if it held it already). A received nil
//     means held, whatever ctx did afterwards.
//   - ctx's error, unchanged, when ctx ended first. If ctx ends after the grant was
//     sent but before it was received, the grant is taken back and released, and
//     the channel carries ctx's error: a caller that walks away never leaves the
//     lock held by nobody.
//   - ErrNotAcquired when WithWait's wait ran out; ErrClosed; ErrInvalidArgument; or
//     a wrapped Redis error.
//
// Waiters of one lock in this process are served first come, first served.
func (m *Mutex) Acquire(ctx context.Context, opts ...AcquireOption) <-chan error {
	req, err := m.request(ctx, opts)
	if err != nil {
		return failed(err)
	}
	return m.c.engine.Acquire(ctx, req)
}

// request checks an acquisition's arguments and makes its engine request.
func (m *Mutex) request(ctx context.Context, opts []AcquireOption) (engine.AcquireRequest, error) {
	cfg := acquireConfig{wait: -1}
	if len(opts) > 0 {
		// Options take a pointer, which moves what it points to onto the heap: a
		// copy, so a call without options allocates nothing here.
		c := cfg
		for _, o := range opts {
			o(&c)
		}
		cfg = c
	}
	if err := m.c.check(ctx, m.name); err != nil {
		return engine.AcquireRequest{}, err
	}
	if cfg.err != nil {
		return engine.AcquireRequest{}, engine.WrapError(m.name, cfg.err)
	}
	return engine.AcquireRequest{Lock: m.name, Owner: m.owner, Fair: m.fair, Lease: cfg.lease, Wait: cfg.wait}, nil
}

func failed(err error) <-chan error {
	c := make(chan error, 1)
	c <- err
	return c
}

// Lock waits for the lock until ctx ends. It returns nil when held, ctx's error
// (unchanged) when ctx ended first, or another error as Acquire's channel carries.
// If ctx ends just as the lock is granted, Lock may return nil: then it holds the
// lock. If ctx ends while this waiter's script call is at the server, Lock returns
// once that call is answered (within OpTimeout), so that a grant it made is never
// left held by nobody; with a stalled server that is later than ctx's end. Lock
// registers nothing on ctx (see engine.AcquireWait), which makes it cheaper than
// receiving from Acquire; and when the client's engine is idle, Lock runs its
// script call on the calling goroutine, with no goroutine hand-off at all.
func (m *Mutex) Lock(ctx context.Context, opts ...AcquireOption) error {
	req, err := m.request(ctx, opts)
	if err != nil {
		return err
	}
	return m.c.engine.AcquireWait(ctx, req)
}

// TryLock waits at most wait for the lock (0: a single attempt), holding it for
// lease once acquired (0: renewed by the watchdog until Unlock). It returns true
// when held (also if ctx ended just as the lock was granted: see Lock); false with
// a nil error when the wait ran out; false with ctx's error when ctx ended first;
// false with ErrInvalidArgument for a negative wait or lease.
func (m *Mutex) TryLock(ctx context.Context, wait, lease time.Duration) (bool, error) {
	opts := []AcquireOption{WithWait(wait)}
	if lease != 0 {
		opts = append(opts, WithLease(lease))
	}
	err := m.Lock(ctx, opts...)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, ErrNotAcquired):
		return false, nil
	default:
		return false, err
	}
}

// Unlock releases one hold (the hold count goes down by one; at zero the lock is
// free, and it goes to the next local waiter or one waiter is woken in each process
// that has waiters). It returns nil when released; ErrNotHeld when this handle does
// not hold the lock, or its hold was lost; ctx's error when ctx ends before the
// answer (the release still goes ahead; but see below for a release Unlock runs
// itself); ErrClosed; ErrInvalidArgument; or a
// wrapped Redis error (the release was tried twice and failed: the hold counts as
// lost, so Lost is closed and nothing renews it, and an owner-guarded release is
// tried once more; at worst the lock ends with its lease).
//
// The release runs under the client's own bounded context even if ctx has already
// ended, so a dead context never leaves the lock held until its lease runs out; ctx
// only bounds how long Unlock waits for the answer. When the client's engine is
// idle and the release is a plain one (no local waiter to hand the lock to), Unlock
// may run it on the calling goroutine (no goroutine hand-off); if ctx ends while
// that release is at the server, Unlock waits for it (within OpTimeout, or the
// timeouts of a client given in Options.Client) and returns its answer, as Lock
// waits for its attempt in flight; if it failed with a transport error, the retry
// goes through the engine and Unlock returns ctx's error.
//
// On a handle shared by goroutines, Unlock releases the hold the handle has when
// the call reaches the engine: if that hold is lost before the release runs, or
// the handle holds nothing then, Unlock returns ErrNotHeld (ErrLockLost), and a
// hold another goroutine of the handle takes meanwhile is left alone. A hold that
// another goroutine of the handle took before the call arrived is the one it
// releases: the handle cannot tell its goroutines apart (see the README's
// "Ownership is the handle").
func (m *Mutex) Unlock(ctx context.Context) error {
	if err := m.c.check(ctx, m.name); err != nil {
		return err
	}
	return engine.WrapError(m.name, m.c.engine.Unlock(ctx, m.name, m.owner))
}

// ForceUnlock deletes the lock whoever holds it, waking its waiters, and reports
// whether it was held. Holders in this client see their Lost channel close; holders
// elsewhere find out at their next renewal. A hold of this client granted while
// the deletion was in flight may have been granted before it ran or after: it is
// checked with one more call, and its Lost closes if the deletion took it. It
// returns ctx's error when ctx ends first (the deletion may still happen),
// ErrClosed, ErrInvalidArgument, or a wrapped Redis error.
func (m *Mutex) ForceUnlock(ctx context.Context) (bool, error) {
	if err := m.c.check(ctx, m.name); err != nil {
		return false, err
	}
	ok, err := m.c.engine.ForceUnlock(ctx, m.name, m.fair)
	return ok, engine.WrapError(m.name, err)
}

// IsLocked reports whether anyone holds the lock.
func (m *Mutex) IsLocked(ctx context.Context) (bool, error) {
	if err := m.c.check(ctx, m.name); err != nil {
		return false, err
	}
	rc := m.c.rc
	n, err := rc.Do(ctx, rc.B().Exists().Key(m.name).Build()).AsInt64()
	if err != nil {
		return false, redisErr(m.name, err)
	}
	return n == 1, nil
}

// HoldCount returns how many times this handle holds the lock (0 when it does not),
// as Redis counts it. It first waits for this handle's Unlock, re-entry, attempt or
// local handoff (to it or from it) still in flight, and for the give-backs then in
// flight of grants the handle never received (one that arrived after its Lock's
// context ended, say),
// taking back first any grant whose Acquire caller walked away on its context's
// end (and cancelling any such caller's waiter), so the count reflects every call
// of the handle's that returned.
func (m *Mutex) HoldCount(ctx context.Context) (int, error) {
	if err := m.c.check(ctx, m.name); err != nil {
		return 0, err
	}
	// An Unlock or handoff of this handle still in flight would make Redis's
	// count disagree with what the caller has seen return.
	if err := m.c.engine.Settle(ctx, m.name, m.owner); err != nil {
		return 0, engine.WrapError(m.name, err)
	}
	// A hold that came from a direct grant is under the grant's field.
	field, err := m.c.engine.HoldField(ctx, m.name, m.owner)
	if err != nil {
		return 0, engine.WrapError(m.name, err)
	}
	if field == "" {
		field = engine.OwnerField(m.c.opts.ClientID, m.owner)
	}
	rc := m.c.rc
	n, err := rc.Do(ctx, rc.B().Hget().Key(m.name).Field(field).Build()).AsInt64()
	if rueidis.IsRedisNil(err) {
		return 0, nil
	}
	if err != nil {
		return 0, redisErr(m.name, err)
	}
	return int(n), nil
}

// RemainTTL returns how long the lock's current lease has left, whoever holds it: 0
// when nobody holds it, and -1 when it is held without an expiry (a foreign client's
// persistent key).
func (m *Mutex) RemainTTL(ctx context.Context) (time.Duration, error) {
	if err := m.c.check(ctx, m.name); err != nil {
		return 0, err
	}
	rc := m.c.rc
	ms, err := rc.Do(ctx, rc.B().Pttl().Key(m.name).Build()).AsInt64()
	if err != nil {
		return 0, redisErr(m.name, err)
	}
	switch {
	case ms == -2:
		return 0, nil
	case ms < 0:
		return -1, nil
	}
	return time.Duration(ms) * time.Millisecond, nil
}

// Lost returns a channel that is closed when this handle's current hold is lost:
// its lease ran out, a renewal failed or found the lock gone, the lock was
// force-released, or the client closed. It is closed before the lease could have
// expired on the server. The channel is never sent on. It is already closed when
// the handle holds nothing; a clean Unlock does not close it. Call Lost after each
// acquisition: a new hold has a new channel. Lost asks the client's engine, so it
// waits briefly for it (no Redis call).
func (m *Mutex) Lost() <-chan struct{} {
	if m.name == "" || m.c.isClosed() {
		return futures.FiredC()
	}
	return m.c.engine.Lost(m.name, m.owner)
}
