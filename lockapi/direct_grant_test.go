package lockapi_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// Direct grants (engine/directgrant.go): a waiter in another client registers, and
// the release gives it the lock in the same script call.

func regKey(name string) string { return "leash_lock_reg:" + fairTagged(name) }

// registered waits until c has a registration for direct grants on name.
func registered(t *testing.T, srv *testredis.Server, c *lockapi.Client, name string) {
	t.Helper()
	eventually(t, 5*time.Second, c.ID()+" to register on "+name, func() bool {
		return do(t, srv, "HEXISTS", regKey(name), c.ID()) == "1"
	})
}

// grantSetup starts a server and n clients on it, and names a lock.
func grantSetup(t *testing.T, n int) (*testredis.Server, []*lockapi.Client, string, context.Context) {
	t.Helper()
	t.Parallel()
	srv := testredis.New(t)
	var cs []*lockapi.Client
	for range n {
		cs = append(cs, newClient(t, srv, lockapi.Options{}))
	}
	return srv, cs, lockName(t, ""), ctxFor(t, 60*time.Second)
}

// A release in one client gives the lock to the registered waiter of another:
// its Lock returns without a script call of its own, its hold is under the
// grant's field, and re-entry, HoldCount and Unlock work on it.
func TestDirectGrantAcrossClients(t *testing.T) {
	srv, cs, name, ctx := grantSetup(t, 2)
	a, b := cs[0], cs[1]
	ma, mb := a.Mutex(name), b.Mutex(name)

	for round := range 5 {
		lockWithin(t, ma, 5*time.Second)
		got := mb.Acquire(ctx)
		registered(t, srv, b, name)
		before := stats(t, b)
		unlock(t, ma)
		if err, ok := receive(got, 5*time.Second); !ok || err != nil {
			t.Fatalf("round %d: b's Acquire after a's Unlock = %v (received %v); want nil", round, err, ok)
		}
		after := stats(t, b)
		if after.DirectGrants != before.DirectGrants+1 {
			t.Fatalf("round %d: b's direct grants %d -> %d; want one more (before %+v, after %+v)", round, before.DirectGrants, after.DirectGrants, before, after)
		}
		h := hashOf(t, srv, name)
		if len(h) != 1 {
			t.Fatalf("round %d: hash %v, want b's grant field alone", round, h)
		}
		for f, v := range h {
			if !strings.HasPrefix(f, b.ID()+":") || v != "1" {
				t.Fatalf("round %d: hash %v, want one field of b's holding 1", round, h)
			}
		}
		if ok, err := ma.TryLock(ctx, 0, 0); ok || err != nil {
			t.Fatalf("round %d: a.TryLock while b holds by grant = %v, %v; want false", round, ok, err)
		}
		lockWithin(t, mb, 5*time.Second) // re-entry, under the grant's field
		if n, err := mb.HoldCount(ctx); err != nil || n != 2 {
			t.Fatalf("round %d: b.HoldCount after re-entry = %d, %v; want 2", round, n, err)
		}
		unlock(t, mb)
		if isClosed(mb.Lost()) {
			t.Fatalf("round %d: b's Lost closed", round)
		}
		unlock(t, mb)
		mustBeLocked(t, srv, name, false)
	}
}

// A listener on the unlock channel that did not register (a Redisson client)
// gets the unlock message: the release does not grant past it.
func TestDirectGrantYieldsToUnregisteredListener(t *testing.T) {
	srv, cs, name, ctx := grantSetup(t, 2)
	a, b := cs[0], cs[1]
	channel := redissonChannel(name)
	ma, mb := a.Mutex(name), b.Mutex(name)

	lockWithin(t, ma, 5*time.Second)
	got := mb.Acquire(ctx)
	registered(t, srv, b, name)
	sub := dialRESP(t, srv.Addr())
	if err := sub.send("SUBSCRIBE", channel); err != nil {
		t.Fatal(err)
	}
	if v, err := sub.read(5 * time.Second); err != nil || fmt.Sprint(v) != fmt.Sprint([]any{"subscribe", channel, int64(1)}) {
		t.Fatalf("SUBSCRIBE %s = %v, %v", channel, v, err)
	}
	before := stats(t, b)
	unlock(t, ma)
	v, err := sub.read(5 * time.Second)
	if err != nil || fmt.Sprint(v) != fmt.Sprint([]any{"message", channel, "0"}) {
		t.Fatalf("message after the release = %v, %v; want [message %s 0]", v, err, channel)
	}
	if err, ok := receive(got, 5*time.Second); !ok || err != nil {
		t.Fatalf("b's Acquire = %v (received %v); want nil, by its own attempt", err, ok)
	}
	if after := stats(t, b); after.DirectGrants != before.DirectGrants {
		t.Fatalf("b took %d direct grants with an unregistered listener; want 0", after.DirectGrants-before.DirectGrants)
	}
	unlock(t, mb)
}

// fakeRegistration writes a registration for client id cid, as lock_acquire
// would, naming waiter id and its grant field; it returns the field.
func fakeRegistration(t *testing.T, srv *testredis.Server, name, cid string, id uint64) string {
	t.Helper()
	field := fmt.Sprintf("%s:%d", cid, uint64(1)<<63|id)
	if do(t, srv, "HSET", regKey(name), cid, fmt.Sprintf("30000|1|%d|%s", id, field)) == "1" {
		do(t, srv, "RPUSH", "leash_lock_regq:"+fairTagged(name), cid)
	}
	return field
}

// A registered waiter that gives up leaves its registration at once, and the
// next waiter (in a third client) is granted the lock.
func TestDirectGrantWaiterLeaves(t *testing.T) {
	srv, cs, name, ctx := grantSetup(t, 3)
	a, b, c := cs[0], cs[1], cs[2]

	ma := a.Mutex(name)
	lockWithin(t, ma, 5*time.Second)
	bctx, cancel := context.WithCancel(ctx)
	gotB := b.Mutex(name).Acquire(bctx)
	registered(t, srv, b, name)
	cancel()
	if err, ok := receive(gotB, 5*time.Second); !ok || err != context.Canceled {
		t.Fatalf("b's cancelled Acquire = %v (received %v); want context.Canceled", err, ok)
	}
	eventually(t, 5*time.Second, "b's registration to go", func() bool {
		return do(t, srv, "HEXISTS", regKey(name), b.ID()) == "0"
	})
	mc := c.Mutex(name)
	gotC := mc.Acquire(ctx)
	registered(t, srv, c, name)
	before := stats(t, c)
	unlock(t, ma)
	if err, ok := receive(gotC, 5*time.Second); !ok || err != nil {
		t.Fatalf("c's Acquire = %v (received %v); want nil", err, ok)
	}
	if got := stats(t, c).DirectGrants - before.DirectGrants; got != 1 {
		t.Fatalf("c took %d direct grants; want 1", got)
	}
	unlock(t, mc)
	mustBeLocked(t, srv, name, false)
}

// A grant to a waiter its client does not have (gone before it could leave) goes
// back, and passes on to the next registered waiter.
func TestDirectGrantToUnknownWaiterGoesBack(t *testing.T) {
	srv, cs, name, ctx := grantSetup(t, 3)
	a, b, c := cs[0], cs[1], cs[2]

	ma := a.Mutex(name)
	lockWithin(t, ma, 5*time.Second)
	// b listens on its grant channel once it has registered anything.
	other := lockName(t, "other")
	mo, mbo := a.Mutex(other), b.Mutex(other)
	lockWithin(t, mo, 5*time.Second)
	gotOther := mbo.Acquire(ctx)
	registered(t, srv, b, other)
	fakeRegistration(t, srv, name, b.ID(), 1<<40) // the oldest: b's, for nobody
	mc := c.Mutex(name)
	gotC := mc.Acquire(ctx)
	registered(t, srv, c, name)
	unlock(t, ma)
	if err, ok := receive(gotC, 5*time.Second); !ok || err != nil {
		t.Fatalf("c's Acquire = %v (received %v); want nil", err, ok)
	}
	if got := stats(t, b).GrantsGivenBack; got != 1 {
		t.Fatalf("b gave back %d grants; want 1", got)
	}
	if v := soleField(t, srv, c, name); v != "1" {
		t.Fatalf("c's hold count = %q, want 1", v)
	}
	unlock(t, mc)
	mustBeLocked(t, srv, name, false)
	unlock(t, mo)
	if err, ok := receive(gotOther, 5*time.Second); !ok || err != nil {
		t.Fatalf("b's Acquire of the other lock = %v (received %v); want nil", err, ok)
	}
	unlock(t, mbo)
}

// A registration of a client that no longer listens on its grant channel (it
// died) is skipped and dropped; the live one behind it is granted.
func TestDirectGrantSkipsDeadClient(t *testing.T) {
	srv, cs, name, ctx := grantSetup(t, 2)
	a, b := cs[0], cs[1]

	ma, mb := a.Mutex(name), b.Mutex(name)
	lockWithin(t, ma, 5*time.Second)
	fakeRegistration(t, srv, name, "dead-client", 7)
	got := mb.Acquire(ctx)
	registered(t, srv, b, name)
	unlock(t, ma)
	if err, ok := receive(got, 5*time.Second); !ok || err != nil {
		t.Fatalf("b's Acquire = %v (received %v); want nil", err, ok)
	}
	if v := soleField(t, srv, b, name); v != "1" {
		t.Fatalf("b's hold count = %q, want 1", v)
	}
	if do(t, srv, "HEXISTS", regKey(name), "dead-client") != "0" {
		t.Fatal("the release left the dead client's registration")
	}
	unlock(t, mb)
	mustBeLocked(t, srv, name, false)
}

// A direct grant whose message never came (lost in a reconnect, say) is claimed
// by the waiter's next attempt.
func TestDirectGrantClaimedWithoutMessage(t *testing.T) {
	srv, cs, name, ctx := grantSetup(t, 2)
	a, b := cs[0], cs[1]

	ma, mb := a.Mutex(name), b.Mutex(name)
	lockWithin(t, ma, 5*time.Second)
	got := mb.Acquire(ctx)
	registered(t, srv, b, name)
	// What a release's grant does, less the message: a's hold goes, b's grant
	// field takes the lock.
	reg := do(t, srv, "HGET", regKey(name), b.ID())
	parts := strings.Split(reg, "|")
	if len(parts) != 4 {
		t.Fatalf("registration %q, want <lease>|<stamp>|<id>|<field>", reg)
	}
	do(t, srv, "DEL", name)
	do(t, srv, "HSET", name, parts[3], "1")
	do(t, srv, "PEXPIRE", name, parts[0])
	// Wake b's waiter (it may be retrying already, after its subscription): its
	// attempt finds the grant and claims it.
	do(t, srv, "PUBLISH", redissonChannel(name), "0")
	if err, ok := receive(got, 5*time.Second); !ok || err != nil {
		t.Fatalf("b's Acquire after a wake-up = %v (received %v); want nil (claimed)", err, ok)
	}
	if s := stats(t, b); s.DirectGrants != 1 {
		t.Fatalf("b's direct grants = %d, want 1 (the claim)", s.DirectGrants)
	}
	if h := hashOf(t, srv, name); h[parts[3]] != "1" || len(h) != 1 {
		t.Fatalf("hash %v, want the grant's field alone", h)
	}
	if n, err := mb.HoldCount(ctx); err != nil || n != 1 {
		t.Fatalf("b.HoldCount = %d, %v; want 1", n, err)
	}
	unlock(t, mb)
	mustBeLocked(t, srv, name, false)
	if err := ma.Unlock(ctx); err == nil {
		t.Fatal("a's Unlock of a hold the test took away = nil, want an error")
	}
}

// A direct grant to b's Acquire that its caller has not received yet; the handle's
// Lock then re-enters (its attempt names the grant's field), and while that attempt
// is in flight the Acquire's context ends, so the unreceived grant is taken back
// and the local hold dropped. The re-entry's reply makes a new hold under the field
// the script counted, the grant's (it once took the handle's own, and the lock was
// held by nobody until the grant's lease ran out; found by a tester).
func TestDirectGrantReentryAfterRevoke(t *testing.T) {
	srv, cs, name, ctx := grantSetup(t, 2)
	a, b := cs[0], cs[1]
	ma, mb := a.Mutex(name), b.Mutex(name)

	lockWithin(t, ma, 5*time.Second)
	actx, acancel := context.WithCancel(context.Background())
	defer acancel()
	ch := mb.Acquire(actx)
	registered(t, srv, b, name)
	unlock(t, ma)
	eventually(t, 5*time.Second, "b's direct grant", func() bool { return stats(t, b).Holds == 1 })
	if len(ch) != 1 {
		t.Fatalf("grant not delivered")
	}

	before := stats(t, b)
	_, resume := freeze(t, srv)
	lockErr := make(chan error, 1)
	go func() { lockErr <- mb.Lock(ctx) }() // a re-entry: its attempt names the grant's field
	eventually(t, 5*time.Second, "the re-entry attempt to be sent", func() bool { return stats(t, b).Attempts > before.Attempts })
	acancel() // the unreceived grant goes back, and the local hold with it
	eventually(t, 5*time.Second, "the revoke", func() bool { return stats(t, b).Revoked > before.Revoked })
	resume()
	if err := <-lockErr; err != nil {
		t.Fatalf("Lock: %v", err)
	}
	n, err := mb.HoldCount(ctx)
	h := hashOf(t, srv, name)
	uerr := mb.Unlock(ctx)
	h2 := hashOf(t, srv, name)
	if n != 1 || err != nil || uerr != nil || len(h2) != 0 {
		t.Fatalf("after Lock returned nil: HoldCount = %d, %v (hash %v); Unlock = %v; hash after Unlock %v (pttl %s)", n, err, h, uerr, h2, do(t, srv, "PTTL", name))
	}
}
