package lockapi_test

import (
	"context"
	"errors"
	"net"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// ownerFieldRE matches one owner field of a leash client: "<client-id>:<number>".
func ownerFieldRE(c *lockapi.Client) *regexp.Regexp {
	return regexp.MustCompile(`^` + regexp.QuoteMeta(c.ID()) + `:[0-9]+$`)
}

// hashOf returns the lock hash as field -> value.
func hashOf(t *testing.T, srv *testredis.Server, name string) map[string]string {
	t.Helper()
	out := map[string]string{}
	raw := do(t, srv, "HGETALL", name)
	if raw == "" {
		return out
	}
	parts := strings.Split(raw, "\n")
	for i := 0; i+1 < len(parts); i += 2 {
		out[parts[i]] = parts[i+1]
	}
	return out
}

// soleField asserts the lock hash has exactly one field, owned by c, and returns
// its value.
func soleField(t *testing.T, srv *testredis.Server, c *lockapi.Client, name string) string {
	t.Helper()
	h := hashOf(t, srv, name)
	if len(h) != 1 {
		t.Fatalf("hash %s = %v, want exactly one field", name, h)
	}
	for f, v := range h {
		if !ownerFieldRE(c).MatchString(f) {
			t.Fatalf("hash %s field %q is not %q:<n>", name, f, c.ID())
		}
		return v
	}
	return ""
}

func TestReentrancy(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{})
	other := newClient(t, srv, lockapi.Options{})
	name := lockName(t, "")
	ctx := ctxFor(t, 30*time.Second)

	m := c.Mutex(name)
	lockWithin(t, m, 5*time.Second)
	lockWithin(t, m, 5*time.Second)
	if n, err := m.HoldCount(ctx); err != nil || n != 2 {
		t.Fatalf("HoldCount = %d, %v; want 2", n, err)
	}
	if v := soleField(t, srv, c, name); v != "2" {
		t.Fatalf("hold count in Redis = %q, want 2", v)
	}
	// Other owners, in this client and in another one, cannot take it.
	for _, h := range []*lockapi.Mutex{c.Mutex(name), other.Mutex(name)} {
		if ok, err := h.TryLock(ctx, 0, 0); ok || err != nil {
			t.Fatalf("TryLock by another owner while held = %v, %v; want false, nil", ok, err)
		}
		if n, err := h.HoldCount(ctx); err != nil || n != 0 {
			t.Fatalf("HoldCount of a non-holder = %d, %v; want 0", n, err)
		}
	}

	unlock(t, m)
	if ok, err := m.IsLocked(ctx); err != nil || !ok {
		t.Fatalf("IsLocked after one of two Unlocks = %v, %v; want true", ok, err)
	}
	if v := soleField(t, srv, c, name); v != "1" {
		t.Fatalf("hold count in Redis after one Unlock = %q, want 1", v)
	}
	if ttl, err := m.RemainTTL(ctx); err != nil || ttl <= 0 {
		t.Fatalf("RemainTTL while held = %v, %v; want > 0", ttl, err)
	}
	unlock(t, m)
	mustBeLocked(t, srv, name, false)
	if ok, err := m.IsLocked(ctx); err != nil || ok {
		t.Fatalf("IsLocked after the last Unlock = %v, %v; want false", ok, err)
	}
	if ttl, err := m.RemainTTL(ctx); err != nil || ttl != 0 {
		t.Fatalf("RemainTTL of a free lock = %v, %v; want 0", ttl, err)
	}
	isErr(t, "third Unlock", m.Unlock(ctx), lockapi.ErrNotHeld)

	// Now free: another owner takes it at once.
	o := other.Mutex(name)
	if ok, err := o.TryLock(ctx, 0, 0); !ok || err != nil {
		t.Fatalf("TryLock of a free lock = %v, %v; want true, nil", ok, err)
	}
	unlock(t, o)
}

func TestUnlockByNonOwner(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{})
	other := newClient(t, srv, lockapi.Options{})
	name := lockName(t, "")
	ctx := ctxFor(t, 30*time.Second)

	isErr(t, "Unlock of a free lock", c.Mutex(name).Unlock(ctx), lockapi.ErrNotHeld)
	m := c.Mutex(name)
	lockWithin(t, m, 5*time.Second)
	isErr(t, "Unlock by another handle of the same client", c.Mutex(name).Unlock(ctx), lockapi.ErrNotHeld)
	isErr(t, "Unlock by a handle of another client", other.Mutex(name).Unlock(ctx), lockapi.ErrNotHeld)
	if n, err := m.HoldCount(ctx); err != nil || n != 1 {
		t.Fatalf("holder's HoldCount after foreign Unlocks = %d, %v; want 1", n, err)
	}
	if isClosed(m.Lost()) {
		t.Fatal("holder's Lost closed by a non-owner's Unlock")
	}
	unlock(t, m)
}

func TestLeaseExpiryHandsOver(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	ca := newClient(t, srv, lockapi.Options{})
	cb := newClient(t, srv, lockapi.Options{})
	name := lockName(t, "")
	const lease = 300 * time.Millisecond

	a := ca.Mutex(name)
	start := time.Now()
	lockWithin(t, a, 5*time.Second, lockapi.WithLease(lease))
	lost := a.Lost()
	if ttl := do(t, srv, "PTTL", name); ttl == "-1" || ttl == "-2" {
		t.Fatalf("PTTL with an explicit lease = %s", ttl)
	}
	b := cb.Mutex(name)
	ch := b.Acquire(ctxFor(t, 10*time.Second))
	err, ok := receive(ch, 5*time.Second)
	took := time.Since(start)
	if !ok || err != nil {
		t.Fatalf("waiter after a %v lease: ok=%v err=%v", lease, ok, err)
	}
	t.Logf("waiter got the lock %v after the holder took it with a %v lease", took, lease)
	if took < 250*time.Millisecond || took > 3*time.Second {
		t.Fatalf("waiter got the lock after %v; want about the lease (%v)", took, lease)
	}
	eventually(t, time.Second, "the expired holder's Lost to close", func() bool { return isClosed(lost) })
	isErr(t, "Unlock after the lease ran out", a.Unlock(ctxFor(t, 5*time.Second)), lockapi.ErrNotHeld)
	if v := soleField(t, srv, cb, name); v != "1" {
		t.Fatalf("new holder's count = %q", v)
	}
	unlock(t, b)
}

func TestWatchdogRenews(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	const watchdog = 600 * time.Millisecond
	c := newClient(t, srv, lockapi.Options{WatchdogTimeout: watchdog})
	other := newClient(t, srv, lockapi.Options{})
	name := lockName(t, "")
	ctx := ctxFor(t, 30*time.Second)

	m := c.Mutex(name)
	lockWithin(t, m, 5*time.Second)
	lost := m.Lost()
	before := stats(t, c).Renewals

	// Holding for four watchdog timeouts is the test itself.
	hold := time.NewTimer(2500 * time.Millisecond)
	select {
	case <-lost:
		hold.Stop()
		t.Fatal("Lost closed while the watchdog should be renewing")
	case <-hold.C:
	}
	if n, err := m.HoldCount(ctx); err != nil || n != 1 {
		t.Fatalf("HoldCount after %v = %d, %v; want 1", 2500*time.Millisecond, n, err)
	}
	pttl, err := strconv.Atoi(do(t, srv, "PTTL", name))
	if err != nil || pttl <= 0 || pttl > int(watchdog.Milliseconds()) {
		t.Fatalf("PTTL = %d (%v); want in (0, %d]", pttl, err, watchdog.Milliseconds())
	}
	if ttl, err := m.RemainTTL(ctx); err != nil || ttl <= 0 || ttl > watchdog {
		t.Fatalf("RemainTTL = %v, %v", ttl, err)
	}
	if isClosed(lost) {
		t.Fatal("Lost closed")
	}
	if ok, err := other.Mutex(name).TryLock(ctx, 0, 0); ok || err != nil {
		t.Fatalf("another client's TryLock = %v, %v; want false, nil", ok, err)
	}
	renewals := stats(t, c).Renewals - before
	t.Logf("%d renewals in %v with a %v watchdog", renewals, 2500*time.Millisecond, watchdog)
	if renewals < 4 {
		t.Fatalf("Renewals grew by %d; want at least 4 (one per %v)", renewals, watchdog/3)
	}
	unlock(t, m)
	mustBeLocked(t, srv, name, false)
}

func TestBadInput(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{})
	ctx := ctxFor(t, 30*time.Second)
	name := lockName(t, "")
	if err := srv.ResetStats(); err != nil {
		t.Fatal(err)
	}

	// calls exercises every call of a handle with ctx and the given options.
	calls := func(m *lockapi.Mutex, ctx context.Context, opts ...lockapi.AcquireOption) map[string]error {
		errs := map[string]error{}
		errs["Acquire"] = <-m.Acquire(ctx, opts...)
		errs["Lock"] = m.Lock(ctx, opts...)
		_, errs["TryLock"] = m.TryLock(ctx, 0, 0)
		errs["Unlock"] = m.Unlock(ctx)
		_, errs["ForceUnlock"] = m.ForceUnlock(ctx)
		_, errs["IsLocked"] = m.IsLocked(ctx)
		_, errs["HoldCount"] = m.HoldCount(ctx)
		_, errs["RemainTTL"] = m.RemainTTL(ctx)
		return errs
	}
	t.Run("EmptyName", func(t *testing.T) {
		m := c.Mutex("")
		for call, err := range calls(m, ctx) {
			isErr(t, call+` on Mutex("")`, err, lockapi.ErrInvalidArgument)
		}
		if !isClosed(m.Lost()) {
			t.Fatal(`Lost of Mutex("") is not closed`)
		}
	})
	t.Run("NilContext", func(t *testing.T) {
		var nilCtx context.Context
		for call, err := range calls(c.Mutex(name), nilCtx) {
			isErr(t, call+" with a nil context", err, lockapi.ErrInvalidArgument)
		}
	})
	t.Run("BadDurations", func(t *testing.T) {
		m := c.Mutex(name)
		for what, opt := range map[string]lockapi.AcquireOption{
			"WithWait(-1ms)":  lockapi.WithWait(-time.Millisecond),
			"WithLease(-1ms)": lockapi.WithLease(-time.Millisecond),
			"WithLease(0)":    lockapi.WithLease(0),
		} {
			isErr(t, "Acquire "+what, <-m.Acquire(ctx, opt), lockapi.ErrInvalidArgument)
			isErr(t, "Lock "+what, m.Lock(ctx, opt), lockapi.ErrInvalidArgument)
		}
		for _, wl := range [][2]time.Duration{{-time.Millisecond, 0}, {0, -time.Millisecond}, {-time.Second, -time.Second}} {
			ok, err := m.TryLock(ctx, wl[0], wl[1])
			if ok {
				t.Fatalf("TryLock(wait %v, lease %v) acquired", wl[0], wl[1])
			}
			isErr(t, "TryLock with a negative duration", err, lockapi.ErrInvalidArgument)
		}
	})
	// Nothing above may have reached Redis as a lock operation.
	cmds, err := srv.CommandStats()
	if err != nil {
		t.Fatal(err)
	}
	mustBeLocked(t, srv, name, false)
	for _, cmd := range []string{"evalsha", "eval", "hget", "exists", "pttl"} {
		if cmds[cmd] != 0 {
			t.Errorf("bad input sent %d %s calls to Redis (commandstats %v)", cmds[cmd], cmd, cmds)
		}
	}
	if s := stats(t, c); s.Waiters != 0 || s.Holds != 0 || s.Acquires != 0 {
		t.Errorf("engine state after bad input: %+v", s)
	}
}

func TestNewBadOptions(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	addrs := []string{srv.Addr()}
	for what, o := range map[string]lockapi.Options{
		"no Addrs":               {},
		"empty address":          {Addrs: []string{""}},
		"negative DB":            {Addrs: addrs, DB: -1},
		"watchdog below minimum": {Addrs: addrs, WatchdogTimeout: lockapi.MinWatchdogTimeout - time.Millisecond},
		"negative watchdog":      {Addrs: addrs, WatchdogTimeout: -time.Second},
		"negative FairWait":      {Addrs: addrs, FairWaitTimeout: -time.Second},
		"negative OpTimeout":     {Addrs: addrs, OpTimeout: -time.Second},
		"negative CloseTimeout":  {Addrs: addrs, CloseTimeout: -time.Second},
		"negative DialTimeout":   {Addrs: addrs, DialTimeout: -time.Second},
		"watchdog of -1ns":       {Addrs: addrs, WatchdogTimeout: -1},
		"PublicYield above max":  {Addrs: addrs, PublicYield: lockapi.MaxPublicYield + time.Millisecond},
		"negative HandoffAge":    {Addrs: addrs, HandoffAge: -time.Millisecond},
	} {
		c, err := lockapi.New(o)
		if c != nil {
			c.Close()
		}
		if c != nil || !errors.Is(err, lockapi.ErrInvalidArgument) {
			t.Errorf("New with %s = %v, %v; want nil, ErrInvalidArgument", what, c, err)
		}
	}
	// The minimum itself is accepted.
	c, err := lockapi.New(lockapi.Options{Addrs: addrs, WatchdogTimeout: lockapi.MinWatchdogTimeout})
	if err != nil {
		t.Fatalf("New with WatchdogTimeout = MinWatchdogTimeout: %v", err)
	}
	c.Close()
}

func TestNewUnreachable(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close() // nobody listens there now
	start := time.Now()
	c, err := lockapi.New(lockapi.Options{Addrs: []string{addr}, DialTimeout: 500 * time.Millisecond})
	took := time.Since(start)
	if c != nil {
		c.Close()
	}
	if c != nil || err == nil {
		t.Fatalf("New against %s (nobody listening) = %v, %v; want an error", addr, c, err)
	}
	if errors.Is(err, lockapi.ErrInvalidArgument) {
		t.Fatalf("unreachable server reported as ErrInvalidArgument: %v", err)
	}
	if took > 5*time.Second {
		t.Fatalf("New took %v with a 500ms DialTimeout", took)
	}
	t.Logf("New against a dead port: %v after %v", err, took)
	// Leaked goroutines are caught by TestMain's goleak check.
}

func TestCallsAfterClose(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{})
	name := lockName(t, "")
	ctx := ctxFor(t, 30*time.Second)
	before := c.Mutex(name)
	if err := c.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	for _, m := range []*lockapi.Mutex{before, c.Mutex(name)} {
		isErr(t, "Acquire after Close", <-m.Acquire(ctx), lockapi.ErrClosed)
		isErr(t, "Lock after Close", m.Lock(ctx), lockapi.ErrClosed)
		ok, err := m.TryLock(ctx, time.Second, 0)
		if ok {
			t.Fatal("TryLock after Close acquired")
		}
		isErr(t, "TryLock after Close", err, lockapi.ErrClosed)
		isErr(t, "Unlock after Close", m.Unlock(ctx), lockapi.ErrClosed)
		_, err = m.ForceUnlock(ctx)
		isErr(t, "ForceUnlock after Close", err, lockapi.ErrClosed)
		_, err = m.IsLocked(ctx)
		isErr(t, "IsLocked after Close", err, lockapi.ErrClosed)
		_, err = m.HoldCount(ctx)
		isErr(t, "HoldCount after Close", err, lockapi.ErrClosed)
		_, err = m.RemainTTL(ctx)
		isErr(t, "RemainTTL after Close", err, lockapi.ErrClosed)
		if !isClosed(m.Lost()) {
			t.Fatal("Lost after Close is not closed")
		}
	}
	_, err := c.Stats(ctx)
	isErr(t, "Stats after Close", err, lockapi.ErrClosed)
	mustBeLocked(t, srv, name, false)
}

func TestCloseReleasesAndFails(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	const closeTimeout = 2 * time.Second
	c := newClient(t, srv, lockapi.Options{CloseTimeout: closeTimeout})
	other := newClient(t, srv, lockapi.Options{})
	name, name2 := lockName(t, "local"), lockName(t, "remote")
	ctx := ctxFor(t, 60*time.Second)

	// name: held by c, with a waiter of c queued behind it.
	h := c.Mutex(name)
	lockWithin(t, h, 5*time.Second)
	lost := h.Lost()
	w := c.Mutex(name)
	wch := w.Acquire(ctx)
	eventually(t, 5*time.Second, "the local waiter to queue", func() bool { return stats(t, c).Waiters == 1 })
	// name2: held by c (reentrantly), with a waiter in another client.
	h2 := c.Mutex(name2)
	lockWithin(t, h2, 5*time.Second)
	lockWithin(t, h2, 5*time.Second)
	lost2 := h2.Lost()
	ow := other.Mutex(name2)
	och := ow.Acquire(ctx)
	eventually(t, 5*time.Second, "the other client's waiter to queue", func() bool { return stats(t, other).Waiters == 1 })

	start := time.Now()
	if err := c.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	took := time.Since(start)
	t.Logf("Close took %v", took)
	if took > closeTimeout+time.Second {
		t.Fatalf("Close took %v with CloseTimeout %v", took, closeTimeout)
	}
	err, ok := receive(wch, time.Second)
	if !ok {
		t.Fatal("pending waiter got no answer from Close")
	}
	isErr(t, "pending waiter at Close", err, lockapi.ErrClosed)
	if !isClosed(lost) || !isClosed(lost2) {
		t.Fatalf("Lost after Close: %v, %v; want both closed", isClosed(lost), isClosed(lost2))
	}
	mustBeLocked(t, srv, name, false)
	// The release woke the other client's waiter.
	err, ok = receive(och, 3*time.Second)
	if !ok || err != nil {
		t.Fatalf("other client's waiter after Close released the lock: ok=%v err=%v", ok, err)
	}
	soleField(t, srv, other, name2)
	unlock(t, ow)
	mustBeLocked(t, srv, name2, false)
}

func TestForceUnlock(t *testing.T) {
	t.Parallel()
	t.Run("SameClient", func(t *testing.T) {
		t.Parallel()
		srv := testredis.New(t)
		c := newClient(t, srv, lockapi.Options{})
		name := lockName(t, "")
		ctx := ctxFor(t, 30*time.Second)
		h := c.Mutex(name)
		lockWithin(t, h, 5*time.Second)
		lost := h.Lost()
		if ok, err := c.Mutex(name).ForceUnlock(ctx); !ok || err != nil {
			t.Fatalf("ForceUnlock of a held lock = %v, %v; want true, nil", ok, err)
		}
		eventually(t, time.Second, "the holder's Lost to close", func() bool { return isClosed(lost) })
		mustBeLocked(t, srv, name, false)
		isErr(t, "Unlock after ForceUnlock", h.Unlock(ctx), lockapi.ErrNotHeld)
		if ok, err := c.Mutex(name).ForceUnlock(ctx); ok || err != nil {
			t.Fatalf("ForceUnlock of a free lock = %v, %v; want false, nil", ok, err)
		}
		// The handle can lock again, with a fresh Lost.
		lockWithin(t, h, 5*time.Second)
		if isClosed(h.Lost()) {
			t.Fatal("Lost of a new hold is already closed")
		}
		unlock(t, h)
	})
	t.Run("OtherClient", func(t *testing.T) {
		t.Parallel()
		srv := testredis.New(t)
		holder := newClient(t, srv, lockapi.Options{WatchdogTimeout: 300 * time.Millisecond})
		forcer := newClient(t, srv, lockapi.Options{})
		waiter := newClient(t, srv, lockapi.Options{})
		name := lockName(t, "")
		ctx := ctxFor(t, 30*time.Second)
		h := holder.Mutex(name)
		lockWithin(t, h, 5*time.Second)
		lost := h.Lost()
		w := waiter.Mutex(name)
		wch := w.Acquire(ctx)
		eventually(t, 5*time.Second, "the waiter to queue", func() bool { return stats(t, waiter).Waiters == 1 })

		start := time.Now()
		if ok, err := forcer.Mutex(name).ForceUnlock(ctx); !ok || err != nil {
			t.Fatalf("ForceUnlock = %v, %v; want true, nil", ok, err)
		}
		err, ok := receive(wch, 3*time.Second)
		if !ok || err != nil {
			t.Fatalf("waiter after ForceUnlock: ok=%v err=%v", ok, err)
		}
		t.Logf("waiter woken %v after ForceUnlock began", time.Since(start))
		eventually(t, 3*time.Second, "the holder's renewal to find the lock gone", func() bool { return isClosed(lost) })
		isErr(t, "holder's Unlock after ForceUnlock", h.Unlock(ctx), lockapi.ErrNotHeld)
		// The old holder's discovery did not disturb the new holder.
		if v := soleField(t, srv, waiter, name); v != "1" {
			t.Fatalf("new holder's count = %q", v)
		}
		unlock(t, w)
	})
}

func TestLostSignal(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{})
	name := lockName(t, "")
	ctx := ctxFor(t, 30*time.Second)

	m := c.Mutex(name)
	if !isClosed(m.Lost()) {
		t.Fatal("Lost of a handle that holds nothing is not closed")
	}
	ch := m.Acquire(ctx)
	if err := <-ch; err != nil {
		t.Fatal(err)
	}
	// The Acquire channel carries one value and is never closed.
	if still, err := pending(ch, 50*time.Millisecond); !still {
		t.Fatalf("second receive from an Acquire channel returned %v", err)
	}
	lost := m.Lost()
	if isClosed(lost) {
		t.Fatal("Lost of a fresh hold is closed")
	}
	lockWithin(t, m, 5*time.Second) // re-entry: the same hold
	if m.Lost() != lost {
		t.Fatal("re-entry changed the Lost channel of the hold")
	}
	unlock(t, m)
	unlock(t, m)
	if isClosed(lost) {
		t.Fatal("a clean Unlock closed Lost")
	}
	if !isClosed(m.Lost()) {
		t.Fatal("Lost after the last Unlock (nothing held) is not closed")
	}
	lockWithin(t, m, 5*time.Second)
	if l2 := m.Lost(); isClosed(l2) || l2 == lost {
		t.Fatal("a new hold must have a new, open Lost channel")
	}
	unlock(t, m)
}

// TestUnlockWithDeadContext: a cancelled context passed to Unlock must not leave
// the lock held until its lease ends.
func TestUnlockWithDeadContext(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{})
	other := newClient(t, srv, lockapi.Options{})
	name := lockName(t, "")

	m := c.Mutex(name)
	lockWithin(t, m, 5*time.Second)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := m.Unlock(ctx); err != nil && err != context.Canceled {
		t.Fatalf("Unlock with a cancelled context = %v; want nil or context.Canceled", err)
	}
	eventually(t, 2*time.Second, "the lock to be released", func() bool { return do(t, srv, "EXISTS", name) == "0" })
	o := other.Mutex(name)
	if ok, err := o.TryLock(ctxFor(t, 5*time.Second), 0, 0); !ok || err != nil {
		t.Fatalf("TryLock after the release = %v, %v", ok, err)
	}
	unlock(t, o)
	isErr(t, "second Unlock", m.Unlock(ctxFor(t, 5*time.Second)), lockapi.ErrNotHeld)

	// A context that ended before Acquire: the caller gets its error, nothing held.
	err := m.Lock(ctx)
	if err != context.Canceled {
		t.Fatalf("Lock with a cancelled context = %v; want context.Canceled", err)
	}
	mustBeLocked(t, srv, name, false)
}
