package lockapi_test

import (
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
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
// else uses sends no script call once its first release (the script) found
// nobody listening (nobody queued, for a fair lock): a Mutex's cycle is
// RESTORE, then HDEL and PUBLISH; a fair lock's RESTORE and LINDEX, then HDEL
// and LINDEX (scripts.RunLoneFreshFair, RunLoneQuietRelease). The lock is free
// after each Unlock, and what the client counts as sent outside scripts
// (Stats.SharedPlainCommands, for the benchmark's request counts) is every
// HDEL, PUBLISH and LINDEX, as no script ran.
func TestQuietReleaseCommands(t *testing.T) {
	t.Parallel()
	const cycles = 20
	for _, tc := range []struct {
		fair bool
		want map[string]int64
	}{
		{false, map[string]int64{"restore": cycles, "hdel": cycles, "publish": cycles}},
		{true, map[string]int64{"restore": cycles, "hdel": cycles, "lindex": 2 * cycles}},
	} {
		t.Run(map[bool]string{false: "Mutex", true: "FairMutex"}[tc.fair], func(t *testing.T) {
			t.Parallel()
			srv := testredis.New(t)
			c := newClient(t, srv, lockapi.Options{})
			name := lockName(t, "")
			m := mutexOf(c, name, tc.fair)
			lockWithin(t, m, 5*time.Second)
			unlock(t, m)
			before, shared := commandsOf(t, srv), stats(t, c).SharedPlainCommands
			for range cycles {
				lockWithin(t, m, 5*time.Second)
				unlock(t, m)
				mustBeLocked(t, srv, name, false)
			}
			after := commandsOf(t, srv)
			want := map[string]int64{"evalsha": 0, "eval": 0, "del": 0}
			var plain int64
			for cmd, n := range tc.want {
				want[cmd] = n
				if cmd != "restore" {
					plain += n
				}
			}
			for cmd, n := range want {
				if got := after[cmd] - before[cmd]; got != n {
					t.Errorf("%d cycles sent %d %s, want %d (before %v, after %v)", cycles, got, cmd, n, before, after)
				}
			}
			if got := stats(t, c).SharedPlainCommands - shared; got != uint64(plain) {
				t.Errorf("SharedPlainCommands grew by %d, want %d", got, plain)
			}
		})
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

// TestQuietFairReleasePassesOn: a fair lock held by a client whose last release
// found nobody queued, with waiters of another client queued behind it: the
// quiet release finds the queue and passes the lock on, and the waiters get it
// in their order.
func TestQuietFairReleasePassesOn(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	a := newClient(t, srv, lockapi.Options{})
	b := newClient(t, srv, lockapi.Options{})
	name := fairName(t, "")
	ma := a.FairMutex(name)
	lockWithin(t, ma, 5*time.Second)
	unlock(t, ma)
	lockWithin(t, ma, 5*time.Second)
	ctx := fairCtx(t, 20*time.Second)
	mb1, mb2 := b.FairMutex(name), b.FairMutex(name)
	first, _ := fairEnqueue(t, srv, mb1, ctx, 1)
	second, _ := fairEnqueue(t, srv, mb2, ctx, 2)
	before := commandsOf(t, srv)
	unlock(t, ma)
	if after := commandsOf(t, srv); after["hdel"] == before["hdel"] {
		t.Errorf("a's release was not quiet (commands before %v, after %v)", before, after)
	}
	fairMustGet(t, "b's first waiter", first)
	if still, err := fairStillWaiting(second, 50*time.Millisecond); !still {
		t.Fatalf("b's second waiter got %v while the first holds", err)
	}
	unlock(t, mb1)
	fairMustGet(t, "b's second waiter", second)
	unlock(t, mb2)
	fairMustBeClean(t, srv, name)
}

// TestFreshFairAttemptBehindAQueue: a leash client whose last release of a fair
// lock found nobody queued takes its next first attempt with RESTORE and LINDEX.
// Here the lock is free but a foreign (Redisson-like) waiter heads the queue,
// woken by the previous holder's release and not yet in: the RESTORE takes the
// lock past it for a moment, LINDEX finds it, and the lock goes back to it (it is
// woken again) while the leash waiter queues behind it. The foreign waiter gets
// the lock first, the leash waiter once it releases.
func TestFreshFairAttemptBehindAQueue(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{})
	name := fairName(t, "")
	m := c.FairMutex(name)
	lockWithin(t, m, 5*time.Second)
	unlock(t, m) // nobody queued: the next first attempt is fresh

	holder, waiter := newFairForeign(t, srv, 5*time.Second), newFairForeign(t, srv, 5*time.Second)
	if got := holder.acquire(t, name, 10*time.Second); got != "" {
		t.Fatalf("foreign holder's acquire = %q, want held", got)
	}
	msgs := waiter.listen(t, name)
	if got := waiter.acquire(t, name, 10*time.Second); got == "" {
		t.Fatal("the foreign waiter took a held lock")
	}
	if got := holder.release(t, name, 10*time.Second); got != "1" {
		t.Fatalf("foreign holder's release = %q, want 1", got)
	}
	if msg, ok := fairRecvString(msgs, 5*time.Second); !ok || msg != "0" {
		t.Fatalf("the foreign waiter was not woken by the release (%q, %v)", msg, ok)
	}

	before := commandsOf(t, srv)
	acq := m.Acquire(fairCtx(t, 20*time.Second))
	fairWaitLen(t, srv, fairQueueKey(name), 2, 5*time.Second)
	if after := commandsOf(t, srv); after["restore"] != before["restore"]+1 {
		t.Errorf("the leash attempt was not fresh: %d RESTOREs", after["restore"]-before["restore"])
	}
	if q := fairList(t, srv, fairQueueKey(name)); q[0] != waiter.owner {
		t.Fatalf("queue %q: the foreign waiter no longer heads it", q)
	}
	mustBeLocked(t, srv, name, false)
	if msg, ok := fairRecvString(msgs, 5*time.Second); !ok || msg != "0" {
		t.Errorf("the foreign waiter was not woken when the lock went back (%q, %v)", msg, ok)
	}
	if got := waiter.acquire(t, name, 10*time.Second); got != "" {
		t.Fatalf("the foreign waiter's acquire at the head of the queue = %q, want held", got)
	}
	if still, err := fairStillWaiting(acq, 50*time.Millisecond); !still {
		t.Fatalf("the leash waiter got %v while the foreign one holds", err)
	}
	if got := waiter.release(t, name, 10*time.Second); got != "1" {
		t.Fatalf("foreign waiter's release = %q, want 1", got)
	}
	fairMustGet(t, "the leash waiter", acq)
	unlock(t, m)
	fairMustBeClean(t, srv, name)
}

// fairRecvString waits up to d for a message.
func fairRecvString(ch <-chan string, d time.Duration) (string, bool) {
	select {
	case s := <-ch:
		return s, true
	case <-time.After(d):
		return "", false
	}
}

// TestQuietReleaseWithoutChannelPermission: a client whose ACL user may run any
// command on any key but publish on no channel (Redis 7's default channel
// permissions for a new user). The release script publishes only to listeners,
// so its uncontended releases never needed to; the quiet release's PUBLISH is
// refused after its HDEL ran. That release still counts as done, and the client
// sends its releases as the script from then on: every Unlock returns nil,
// nothing is reported lost, and the lock is free after each.
func TestQuietReleaseWithoutChannelPermission(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	do(t, srv, "ACL", "SETUSER", "nopub", "on", ">pw", "~*", "resetchannels", "+@all")
	c := newClient(t, srv, lockapi.Options{Username: "nopub", Password: "pw"})
	name := lockName(t, "")
	m := c.Mutex(name)
	for i := range 6 {
		lockWithin(t, m, 5*time.Second)
		lost := m.Lost()
		if err := m.Unlock(ctxFor(t, 5*time.Second)); err != nil {
			t.Errorf("cycle %d: Unlock = %v, want nil", i, err)
		}
		if isClosed(lost) {
			t.Errorf("cycle %d: Lost closed by an Unlock that released the lock", i)
		}
		mustBeLocked(t, srv, name, false)
	}
	n := commandsOf(t, srv)["hdel"]
	if n == 0 {
		t.Error("no HDEL ran: the test does not reach the quiet release")
	}
	// The refused PUBLISH ran nothing (Redis counts it as rejected): the client
	// counts the HDELs alone.
	if got := stats(t, c).SharedPlainCommands; got != uint64(n) {
		t.Errorf("SharedPlainCommands = %d, want the %d HDELs", got, n)
	}
}

// TestFreshFairAttemptReplyLost: as in TestFreshFairAttemptBehindAQueue, a
// fresh fair attempt meets a free lock headed by a live foreign waiter, but the
// connection fails: the pair's reply is lost, or the give-back (fair_release)
// never reaches Redis. The lock RESTORE made under the handle's field must not
// be kept past the queue: the engine gives the field back before its retry, so
// the leash waiter stays behind the foreign one (its Lock runs out of time) and
// the foreign waiter takes the lock.
func TestFreshFairAttemptReplyLost(t *testing.T) {
	t.Parallel()
	for _, dropGiveBack := range []bool{false, true} {
		t.Run(map[bool]string{false: "reply lost", true: "give-back lost"}[dropGiveBack], func(t *testing.T) {
			t.Parallel()
			srv := testredis.New(t)
			proxy := newReplyProxy(t, srv)
			c := newClient(t, srv, lockapi.Options{Addrs: []string{proxy.Addr()}, OpTimeout: 2 * time.Second})
			name := fairName(t, "")
			m := c.FairMutex(name)
			lockWithin(t, m, 5*time.Second)
			unlock(t, m) // nobody queued: the next first attempt is fresh

			holder, waiter := newFairForeign(t, srv, time.Minute), newFairForeign(t, srv, time.Minute)
			if got := holder.acquire(t, name, 10*time.Second); got != "" {
				t.Fatalf("foreign holder's acquire = %q, want held", got)
			}
			if got := waiter.acquire(t, name, 10*time.Second); got == "" {
				t.Fatal("the foreign waiter took a held lock")
			}
			if got := holder.release(t, name, 10*time.Second); got != "1" {
				t.Fatalf("foreign holder's release = %q, want 1", got)
			}
			if dropGiveBack {
				proxy.armN(stormSHA(scripts.FairRelease), 1, true)
			} else {
				proxy.arm("RESTORE")
			}
			err := m.Lock(fairCtx(t, 2*time.Second))
			if proxy.cutCount() != 1 {
				t.Fatalf("the proxy cut %d requests or replies, want 1 (Lock: %v)", proxy.cutCount(), err)
			}
			if err == nil {
				t.Fatalf("the leash waiter got the lock past the foreign head of the queue (queue %q, hash %q)",
					fairList(t, srv, fairQueueKey(name)), do(t, srv, "HGETALL", name))
			}
			fairWaitFor(t, 5*time.Second, "the handle's field to be gone", func() bool {
				return do(t, srv, "EXISTS", name) == "0"
			})
			if got := waiter.acquire(t, name, 10*time.Second); got != "" {
				t.Fatalf("the foreign head's acquire = %q, want held", got)
			}
			if got := waiter.release(t, name, 10*time.Second); got != "1" {
				t.Fatalf("foreign waiter's release = %q, want 1", got)
			}
			fairWaitLen(t, srv, fairQueueKey(name), 0, 5*time.Second)
			lockWithin(t, m, 5*time.Second)
			unlock(t, m)
			fairMustBeClean(t, srv, name)
		})
	}
}
