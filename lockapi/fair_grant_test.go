package lockapi_test

import (
	"context"
	"errors"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// Tests of the fair lock's direct grants (internal/scripts/fair_lib.lua): a release
// whose queue head registered in leash_lock_grants:{name} gives it the lock in the
// same script and publishes "leash:grant:<waiter id>" on its channel.

// fairGrantsKey is the direct-grants hash of a fair lock.
func fairGrantsKey(name string) string { return "leash_lock_grants:" + fairTagged(name) }

// fairGrantLost plays a release that grants the lock directly to the queue head
// whose message is lost: what fair_release.lua does (pop the head, let the next
// head's deadline come down to now + allowance, give the head the lock) without
// the PUBLISH. KEYS: lock, queue, deadlines, grants; ARGV: owner (must head the
// queue), lease ms, now ms, allowance ms.
const fairGrantLost = `
if redis.call('lindex', KEYS[2], 0) ~= ARGV[1] then
	return redis.error_reply('the owner does not head the queue')
end
redis.call('del', KEYS[1])
redis.call('lpop', KEYS[2])
redis.call('zrem', KEYS[3], ARGV[1])
redis.call('hdel', KEYS[4], ARGV[1])
local next = redis.call('lindex', KEYS[2], 0)
if next then
	redis.call('zadd', KEYS[3], 'LT', tonumber(ARGV[3]) + tonumber(ARGV[4]), next)
end
redis.call('hset', KEYS[1], ARGV[1], 1)
redis.call('pexpire', KEYS[1], ARGV[2])
return 1
`

// fairGrantSilently runs fairGrantLost for owner, the head of name's queue.
func fairGrantSilently(t *testing.T, srv *testredis.Server, name, owner string, lease, allowance time.Duration) {
	t.Helper()
	do(t, srv, "EVAL", fairGrantLost, "4", name, fairQueueKey(name), fairTimeoutKey(name), fairGrantsKey(name),
		owner, strconv.FormatInt(lease.Milliseconds(), 10), strconv.FormatInt(time.Now().UnixMilli(), 10),
		strconv.FormatInt(allowance.Milliseconds(), 10))
}

// fairGrantSettle waits until c has made attempts fair_acquire calls (a queued
// waiter makes two: the one that queues it, and one more once its channel pattern
// is subscribed), the server has run scripts script calls since the last
// ResetStats (the scripts must be cached: fairGrantWarm), and c's engine has no
// call on lock name in flight, its last reply stepped (DescribeLock's "inflight
// 0"). A release made after that finds the waiter with no call in flight, so it
// takes its grant from the message alone. (Without the last wait, a reply still on
// its way to c's engine made the waiter attempt again: 1 run in 9 full suites
// run beside a storm loop.)
func fairGrantSettle(t *testing.T, srv *testredis.Server, c *lockapi.Client, name string, attempts uint64, scripts int64) {
	t.Helper()
	fairWaitFor(t, 10*time.Second, "the waiter's attempts", func() bool { return stats(t, c).Attempts >= attempts })
	fairWaitFor(t, 10*time.Second, "the attempts to run on the server", func() bool {
		return fairStat(t, srv, "evalsha", "eval") >= scripts
	})
	fairWaitFor(t, 10*time.Second, "the engine to have no call in flight", func() bool {
		return strings.Contains(lockapi.DescribeLock(c, name), "; inflight 0;")
	})
}

// fairGrantWarm takes and releases another fair lock with c, so the server has
// fair_acquire and fair_release cached: a script's first call on a server is an
// EVALSHA answered NOSCRIPT and then an EVAL, which would count as two calls.
func fairGrantWarm(t *testing.T, c *lockapi.Client) {
	t.Helper()
	m := c.FairMutex(fairName(t, "warm-up"))
	if err := m.Lock(fairCtx(t, 5*time.Second)); err != nil {
		t.Fatalf("warm-up Lock: %v", err)
	}
	unlock(t, m)
}

// fairMustRegister asserts owner's registration in the grants hash is
// "<lease ms>:<waiter id>.<registration number>".
func fairMustRegister(t *testing.T, srv *testredis.Server, name, owner string, lease time.Duration) {
	t.Helper()
	re := regexp.MustCompile(`^` + strconv.FormatInt(lease.Milliseconds(), 10) + `:\d+\.\d+$`)
	if reg := do(t, srv, "HGET", fairGrantsKey(name), owner); !re.MatchString(reg) {
		t.Fatalf("grants registration of the queued waiter %s = %q, want %q", owner, reg, re)
	}
}

// TestFairDirectGrantAcrossClients: a waiter of one client queued behind a holder
// of another is registered for a direct grant; the holder's Unlock gives it the
// lock with that one script call (no call of the waiter's), the waiter takes the
// grant from the message (DirectGrants), holds it once, and its registration is gone.
func TestFairDirectGrantAcrossClients(t *testing.T) {
	srv := testredis.New(t)
	name := fairName(t, "")
	opts := lockapi.Options{FairWaitTimeout: time.Minute} // ≥ the 30 s watchdog: waiters register
	c1, c2 := newClient(t, srv, opts), newClient(t, srv, opts)

	fairGrantWarm(t, c1)
	holder := c1.FairMutex(name)
	if err := holder.Lock(fairCtx(t, 5*time.Second)); err != nil {
		t.Fatalf("holder Lock: %v", err)
	}
	if err := srv.ResetStats(); err != nil {
		t.Fatal(err)
	}
	waiter := c2.FairMutex(name)
	got, field := fairEnqueue(t, srv, waiter, fairCtx(t, 30*time.Second), 1)
	fairGrantSettle(t, srv, c2, name, 2, 2)
	fairMustRegister(t, srv, name, field, lockapi.DefaultWatchdogTimeout)

	if err := srv.ResetStats(); err != nil {
		t.Fatal(err)
	}
	unlock(t, holder)
	if err, ok := fairRecv(got, 5*time.Second); !ok || err != nil {
		t.Fatalf("waiter after the holder's Unlock: %v (returned %v)", err, ok)
	}
	if n := fairStat(t, srv, "evalsha", "eval"); n != 1 {
		t.Errorf("%d script calls from the Unlock to the waiter's acquisition, want 1 (the release)", n)
	}
	if s := stats(t, c2); s.DirectGrants != 1 {
		t.Errorf("waiter's client DirectGrants = %d, want 1 (stats %+v)", s.DirectGrants, s)
	}
	if hk, cnt := do(t, srv, "HKEYS", name), do(t, srv, "HGET", name, field); hk != field || cnt != "1" {
		t.Errorf("lock hash fields %q, the waiter's count %q; want only %q with count 1", hk, cnt, field)
	}
	if do(t, srv, "HEXISTS", fairGrantsKey(name), field) != "0" {
		t.Errorf("the granted waiter is still registered for a grant")
	}
	unlock(t, waiter)
	fairGrantClean(t, srv, name)
}

// unheardLease is the watchdog of fairUnheardGrant's client: ≤ its allowance, so
// its waiter registers for direct grants.
const unheardLease, unheardAllowance = time.Second, 1500 * time.Millisecond

// fairUnheardGrant queues one waiter (a FairMutex handle) of a fresh client behind
// a raw holder, then grants it the lock directly without telling it (no message),
// as a release would whose message got lost. It returns the Lock's channel and the
// waiter's owner field.
func fairUnheardGrant(t *testing.T) (*testredis.Server, *lockapi.Client, string, *lockapi.Mutex, <-chan error, string) {
	t.Helper()
	srv := testredis.New(t)
	name := fairName(t, "")
	c := newClient(t, srv, lockapi.Options{WatchdogTimeout: unheardLease, FairWaitTimeout: unheardAllowance})
	do(t, srv, "HSET", name, "X:1", "1")
	do(t, srv, "PEXPIRE", name, "60000")
	m := c.FairMutex(name)
	got, field := fairEnqueue(t, srv, m, fairCtx(t, 20*time.Second), 1)
	fairMustRegister(t, srv, name, field, unheardLease)
	fairGrantSilently(t, srv, name, field, 30*time.Second, unheardAllowance)
	return srv, c, name, m, got, field
}

// TestFairUnheardGrantIsClaimedOnce: a queued leash waiter is granted the lock
// directly but never hears of it (no message). Its next periodic attempt must
// claim the grant: Lock returns, the hold is counted once (not re-entered: count 1,
// so one Unlock frees the lock), and its lease is renewed to the waiter's own. The
// raw grant's lease is far longer than the waiter's, so the waiter cannot get the
// lock by waiting for the grant to expire.
func TestFairUnheardGrantIsClaimedOnce(t *testing.T) {
	srv, c, name, w, got, field := fairUnheardGrant(t)
	err, ok := fairRecv(got, 5*time.Second)
	if !ok {
		t.Fatalf("the waiter did not claim its unheard grant within 5s (retries every %v); hash %q",
			unheardAllowance/3, do(t, srv, "HGETALL", name))
	}
	if err != nil {
		t.Fatalf("Lock: %v", err)
	}
	if n, err := w.HoldCount(fairCtx(t, 5*time.Second)); err != nil || n != 1 {
		t.Errorf("HoldCount = %d, %v; want 1", n, err)
	}
	if cnt := do(t, srv, "HGET", name, field); cnt != "1" {
		t.Errorf("lock hash count of the waiter = %q, want \"1\" (the claim counted the grant twice)", cnt)
	}
	if ms, _ := strconv.ParseInt(do(t, srv, "PTTL", name), 10, 64); ms <= 0 || ms > unheardLease.Milliseconds() {
		t.Errorf("PTTL after the claim = %d ms, want the waiter's lease (≤ %v): the claim did not renew", ms, unheardLease)
	}
	if s := stats(t, c); s.DirectGrants != 0 {
		t.Errorf("DirectGrants = %d with no grant message sent", s.DirectGrants)
	}
	unlock(t, w)
	if do(t, srv, "EXISTS", name) != "0" {
		t.Fatalf("the lock is still held after one Unlock: %q", do(t, srv, "HGETALL", name))
	}
	fairGrantClean(t, srv, name)
}

// TestFairUnheardGrantGivenBackOnCancel: W1 and W2 (two clients) are queued in that
// order; W1 is granted the lock directly but does not hear of it, and its context
// is cancelled before its next attempt (seconds away). Its Acquire returns
// context.Canceled, and its leave gives the grant back and passes the lock on: W2
// is granted it directly at once, and W1's field is gone from the lock hash.
func TestFairUnheardGrantGivenBackOnCancel(t *testing.T) {
	const allowance = 30 * time.Second // retries every 10 s; the 30 s watchdog registers
	srv := testredis.New(t)
	name := fairName(t, "")
	c1 := newClient(t, srv, lockapi.Options{FairWaitTimeout: allowance})
	c2 := newClient(t, srv, lockapi.Options{FairWaitTimeout: allowance})

	do(t, srv, "HSET", name, "X:1", "1")
	do(t, srv, "PEXPIRE", name, "60000")
	fairGrantWarm(t, c1)
	if err := srv.ResetStats(); err != nil {
		t.Fatal(err)
	}
	ctx1, cancel1 := context.WithCancel(context.Background())
	defer cancel1()
	w1, w2 := c1.FairMutex(name), c2.FairMutex(name)
	got1, f1 := fairEnqueue(t, srv, w1, ctx1, 1)
	fairGrantSettle(t, srv, c1, name, 2, 2) // W1 has no attempt in flight that could claim the grant
	got2, f2 := fairEnqueue(t, srv, w2, fairCtx(t, 30*time.Second), 2)
	fairGrantSettle(t, srv, c2, name, 2, 4)
	if q := fairList(t, srv, fairQueueKey(name)); !slices.Equal(q, []string{f1, f2}) {
		t.Fatalf("queue = %q, want [W1 %s, W2 %s]", q, f1, f2)
	}

	fairGrantSilently(t, srv, name, f1, allowance, allowance)
	cancel1()
	err, ok := fairRecv(got1, 5*time.Second)
	if !ok || !errors.Is(err, context.Canceled) {
		t.Fatalf("W1 after cancel: %v (returned %v), want context.Canceled", err, ok)
	}
	err, ok = fairRecv(got2, 3*time.Second)
	if !ok {
		t.Fatalf("W2 did not get the lock within 3s of W1's cancel; hash %q, queue %q, grants %q",
			do(t, srv, "HGETALL", name), fairList(t, srv, fairQueueKey(name)), do(t, srv, "HGETALL", fairGrantsKey(name)))
	}
	if err != nil {
		t.Fatalf("W2 Lock: %v", err)
	}
	if hk := do(t, srv, "HKEYS", name); hk != f2 {
		t.Errorf("lock hash fields = %q, want only W2's %q (W1's grant was not given back)", hk, f2)
	}
	if n, err := w1.HoldCount(fairCtx(t, 5*time.Second)); err != nil || n != 0 {
		t.Errorf("W1 HoldCount = %d, %v; want 0", n, err)
	}
	if s := stats(t, c2); s.DirectGrants != 1 {
		t.Errorf("W2's client DirectGrants = %d, want 1: the leave should pass the lock on directly", s.DirectGrants)
	}
	unlock(t, w2)
	fairGrantClean(t, srv, name)
}

// TestFairRedissonHeadIsWokenNotGranted: a Redisson-style waiter (raw Lua, not
// registered for grants) heads the queue behind a leash holder. The leash Unlock
// must leave the lock free and the foreign owner at the head of the queue, and
// wake it with "0" on its own channel; the foreign client then takes the lock.
func TestFairRedissonHeadIsWokenNotGranted(t *testing.T) {
	const allowance = time.Minute
	srv := testredis.New(t)
	name := fairName(t, "")
	c := newClient(t, srv, lockapi.Options{FairWaitTimeout: allowance})
	foreign := newFairForeign(t, srv, allowance)
	notes := foreign.listen(t, name)

	holder := c.FairMutex(name)
	if err := holder.Lock(fairCtx(t, 5*time.Second)); err != nil {
		t.Fatalf("holder Lock: %v", err)
	}
	if r := foreign.acquire(t, name, 30*time.Second); r == "" {
		t.Fatalf("foreign acquire while leash holds succeeded")
	}
	if do(t, srv, "HEXISTS", fairGrantsKey(name), foreign.owner) != "0" {
		t.Fatalf("the foreign waiter is registered for a grant")
	}
	unlock(t, holder)
	if do(t, srv, "EXISTS", name) != "0" {
		t.Fatalf("after the leash Unlock the lock is held: %q (granted to a head that did not register)",
			do(t, srv, "HGETALL", name))
	}
	select {
	case msg := <-notes:
		if msg != "0" {
			t.Errorf("foreign client got %q on its channel, want \"0\"", msg)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the foreign client was not woken on its channel after the leash Unlock")
	}
	if q := fairList(t, srv, fairQueueKey(name)); !slices.Equal(q, []string{foreign.owner}) {
		t.Errorf("queue after the Unlock = %q, want the foreign owner still at its head", q)
	}
	if r := foreign.acquire(t, name, 30*time.Second); r != "" {
		t.Fatalf("foreign acquire after the wake-up = %q, want nil (held)", r)
	}
	if r := foreign.release(t, name, 30*time.Second); r != "1" {
		t.Fatalf("foreign release = %q, want 1", r)
	}
	fairGrantClean(t, srv, name)
}

// TestFairUnheardGrantAndTryLockOfItsHandle: a waiter W of handle h is granted the
// lock directly and has not heard yet (the message is lost). A TryLock on the same
// handle meanwhile finds h's field: it claims it (the engine knows of no hold of
// h's), so Redis counts the grant once, as the TryLock's hold; W, its entry in
// the Redis queue taken with it, then re-enters as a holder of the handle (count
// 2). If W's periodic attempt comes first, W claims the grant and the TryLock
// re-enters: count 2 again. Re-entering the grant instead of claiming it would
// count it twice on Redis and once in the engine. Both get the lock, it stays
// held until both Unlocks, and then it is freed.
func TestFairUnheardGrantAndTryLockOfItsHandle(t *testing.T) {
	srv, _, name, h, got, field := fairUnheardGrant(t)

	ok, err := h.TryLock(fairCtx(t, 5*time.Second), 0, 0)
	if err != nil || !ok {
		t.Fatalf("TryLock on the granted handle = %v, %v; want true", ok, err)
	}
	if err, ok := fairRecv(got, 5*time.Second); !ok || err != nil {
		t.Fatalf("the queued waiter's Lock = %v (answered %v); want nil once it re-enters", err, ok)
	}
	if cnt := do(t, srv, "HGET", name, field); cnt != "2" {
		t.Errorf("with both in, the hash counts %q for the handle, want 2", cnt)
	}
	for i := range 2 {
		if do(t, srv, "EXISTS", name) != "1" {
			t.Fatalf("the lock is free with %d of 2 holds still unreleased", 2-i)
		}
		unlock(t, h)
	}
	fairWaitFor(t, 5*time.Second, "the lock freed after both Unlocks", func() bool { return do(t, srv, "EXISTS", name) == "0" })
	fairGrantClean(t, srv, name)
}

// fairGrantClean checks that name's lock, queue and grants hash are all gone.
func fairGrantClean(t *testing.T, srv *testredis.Server, name string) {
	t.Helper()
	fairMustBeClean(t, srv, name)
	if do(t, srv, "EXISTS", fairGrantsKey(name)) != "0" {
		t.Errorf("grants hash left behind: %q", do(t, srv, "HGETALL", fairGrantsKey(name)))
	}
}
