package lockapi_test

import (
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// Quiet releases (engine scriptCall.quiet, scripts.RunLoneQuietRelease): the
// last count of a lock on which nobody listened at its last release goes as HDEL
// and PUBLISH instead of the release script.

// commandsOf reads srv's command counts or fails the test.
func commandsOf(t *testing.T, srv *testredis.Server) map[string]int64 {
	t.Helper()
	c, err := srv.CommandStats()
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestQuietReleaseCommands: one goroutine taking and releasing a lock nobody
// else uses costs RESTORE, HDEL and PUBLISH per cycle, and no script call, once
// its first release (the script) found nobody listening. The lock is free after
// each Unlock.
func TestQuietReleaseCommands(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{})
	name := lockName(t, "")
	m := c.Mutex(name)
	lockWithin(t, m, 5*time.Second)
	unlock(t, m)
	const cycles = 20
	before := commandsOf(t, srv)
	for range cycles {
		lockWithin(t, m, 5*time.Second)
		unlock(t, m)
		mustBeLocked(t, srv, name, false)
	}
	after := commandsOf(t, srv)
	for cmd, want := range map[string]int64{"restore": cycles, "hdel": cycles, "publish": cycles, "evalsha": 0, "eval": 0} {
		if got := after[cmd] - before[cmd]; got != want {
			t.Errorf("%d cycles sent %d %s, want %d (before %v, after %v)", cycles, got, cmd, want, before, after)
		}
	}
}

// TestQuietReleaseReplyLost: the reply to a quiet release is lost with its
// connection after the server ran it. The engine sends it again, which finds
// the field gone: Unlock returns nil, the lock is free, and the handle takes it
// again at once.
func TestQuietReleaseReplyLost(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	proxy := newReplyProxy(t, srv)
	c := newClient(t, srv, lockapi.Options{Addrs: []string{proxy.Addr()}, OpTimeout: 2 * time.Second})
	name := lockName(t, "")
	m := c.Mutex(name)
	for range 2 {
		lockWithin(t, m, 5*time.Second)
		unlock(t, m)
	}
	lockWithin(t, m, 5*time.Second)
	proxy.arm("HDEL")
	if err := m.Unlock(ctxFor(t, 10*time.Second)); err != nil {
		t.Errorf("Unlock with its reply lost: %v, want nil", err)
	}
	if proxy.cutCount() != 1 {
		t.Fatalf("the proxy cut %d replies, want 1: the release was not quiet", proxy.cutCount())
	}
	mustBeLocked(t, srv, name, false)
	lockWithin(t, m, 5*time.Second)
	unlock(t, m)
	mustBeLocked(t, srv, name, false)
}

// TestQuietReleaseWakesRegisteredWaiter: a waiter of another client registers
// for a direct grant while the lock is held by a client whose last release
// found nobody listening, so that client's release is quiet and grants nobody.
// The waiter hears the unlock message and takes the lock with a call of its
// own; the holder's next release, having been heard, is the script's again.
func TestQuietReleaseWakesRegisteredWaiter(t *testing.T) {
	srv, cs, name, ctx := grantSetup(t, 2)
	a, b := cs[0], cs[1]
	ma, mb := a.Mutex(name), b.Mutex(name)
	lockWithin(t, ma, 5*time.Second)
	unlock(t, ma) // nobody listened: the next release may be quiet
	lockWithin(t, ma, 5*time.Second)
	got := mb.Acquire(ctx)
	registered(t, srv, b, name)
	before := commandsOf(t, srv)
	unlock(t, ma)
	if err, ok := receive(got, 5*time.Second); !ok || err != nil {
		t.Fatalf("b's Acquire after a's quiet Unlock = %v (received %v); want nil", err, ok)
	}
	after := commandsOf(t, srv)
	if after["hdel"] == before["hdel"] {
		t.Errorf("a's release was not quiet (commands before %v, after %v)", before, after)
	}
	if s := stats(t, b); s.DirectGrants != 0 {
		t.Errorf("b got %d direct grants; a quiet release grants none", s.DirectGrants)
	}
	// a waits behind b now, and b's release, heard by a, grants a directly or
	// wakes it; a's own next release goes by the script (it was heard).
	gotA := ma.Acquire(ctx)
	registered(t, srv, a, name)
	unlock(t, mb)
	if err, ok := receive(gotA, 5*time.Second); !ok || err != nil {
		t.Fatalf("a's Acquire after b's Unlock = %v (received %v); want nil", err, ok)
	}
	gotB := mb.Acquire(ctx)
	registered(t, srv, b, name)
	grantsBefore := stats(t, b).DirectGrants
	unlock(t, ma)
	if err, ok := receive(gotB, 5*time.Second); !ok || err != nil {
		t.Fatalf("b's second Acquire = %v (received %v); want nil", err, ok)
	}
	if s := stats(t, b); s.DirectGrants != grantsBefore+1 {
		t.Errorf("b's direct grants %d -> %d: a's release after a heard one was not the script's", grantsBefore, s.DirectGrants)
	}
	unlock(t, mb)
	freedSoon(t, srv, name)
}
