package engine

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// registeredName is the grant name a fair_acquire call registers its waiter under
// (ARGV[6], "<lease ms>:<grant name>"), which a release's grant message names.
func registeredName(c scriptCall) string {
	_, name, _ := strings.Cut(c.args[5], ":")
	return name
}

// fairGrantNotice delivers "leash:grant:<name>" on owner's channel of lock.
func (h *mh) fairGrantNotice(lock string, owner uint64, name string) {
	h.m.handle(unlockNotice{
		channel: channelName(lock) + ":" + testClientID + ":" + strconv.FormatUint(owner, 10),
		payload: grantPrefix + name,
	}, h.now)
}

// fairHeadRedis models what a fair lock's hash holds for owner 1 (field cid:1) while
// another process holds the lock at first, owner 1's waiter heading the Redis
// queue: enough of fair_acquire.lua and fair_lib.lua's pass_on for the test below.
type fairHeadRedis struct {
	otherHolds bool   // the other process's field is there
	count      int    // cid:1's count
	reg        string // owner 1's registration's grant name
	granted    string // the grant name pass_on published
}

// release is the other process's fair_release: pass_on grants the registered
// head (owner 1) directly, cid:1 = 1, and publishes "leash:grant:<name>".
func (r *fairHeadRedis) release() { r.otherHolds, r.count, r.granted = false, 1, r.reg }

// acquire runs fair_acquire call c of owner 1.
func (r *fairHeadRedis) acquire(c scriptCall) scripts.Reply {
	if r.otherHolds && r.count == 0 && c.args[4] != "1" && c.args[5] != "" {
		r.reg = registeredName(c) // queued: registered
	}
	switch {
	case !r.otherHolds && r.count == 0: // free, owner 1 heads the queue: it takes it
		r.count = 1
		return replyNil
	case r.count > 0: // cid:1 is there: claimed (ARGV[7] "1") or re-entered
		if c.args[6] != "1" {
			r.count++
		}
		return replyNil
	case c.args[4] == "1": // a single try
		return replyInt(1)
	}
	return replyPTTL(30 * time.Second)
}

// Owner 1's waiter a is in a fair lock's Redis queue, registered for a direct
// grant; the same handle's TryLock (another goroutine's) is in flight. Another
// process's release grants a directly (cid:1 = 1, and a "leash:grant:<a>" message
// on owner 1's channel), and Redis runs the try before or after it. The engine
// must end up counting what Redis counts, whatever order the try's reply and the
// grant's message (two connections) come in.
//
// The bug this catches: with the grant first, a try that does not claim re-enters
// cid:1 (cid:1 = 2), and its reply, nil, looks the same as a take of the free
// lock. grant then takes a out of the Redis queue (ownerEntryTaken), so the
// grant's message, coming after the reply, grants nobody, and a's re-entry makes
// cid:1 = 3 while the engine counts 2: the handle's releases are one count short
// (its last Unlock finds the surplus, and a local handoff that grants early there
// loses the receiver's hold at the reply). The fix has two parts (fairAttempt,
// fairGranted): the try claims the unheard grant, and a grant message that finds
// the owner's call in flight grants nobody but wakes a, whose next attempt claims
// or re-enters after the try. With the claim alone, the message handled while the
// try is in flight counts the grant twice (Redis 1, the engine 2).
func TestMachineFairGrantBesideHandlesTry(t *testing.T) {
	for _, tc := range []struct {
		name                 string
		tryBeforeGrant       bool // Redis runs the try before the release that grants a
		messageBeforeTryDone bool // the grant's message comes before the try's reply
	}{
		{"grant then try, message after the try's reply", false, false},
		{"grant then try, message while the try is in flight", false, true},
		{"try then grant, message after the try's reply", true, false},
		{"try then grant, message while the try is in flight", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMH(t, func(c *config) { c.fairWait = 5 * time.Minute })
			redis := &fairHeadRedis{otherHolds: true}
			a := h.acquireFair("L", 1)
			join := h.take().one(t, scripts.FairAcquire)
			if join.args[5] == "" {
				t.Fatalf("a's join %v does not register for a direct grant", join.args)
			}
			h.reply(join, redis.acquire(join), nil) // queued: owner 1 heads the Redis queue
			h.take()
			try := h.tryFair("L", 1)
			tryCall := h.take().one(t, scripts.FairAcquire)
			message := func() { h.fairGrantNotice("L", 1, redis.granted) }
			var tryReply scripts.Reply
			if tc.tryBeforeGrant {
				tryReply = redis.acquire(tryCall)
				redis.release()
			} else {
				redis.release()
				tryReply = redis.acquire(tryCall)
			}
			if tc.messageBeforeTryDone {
				message()
			}
			h.reply(tryCall, tryReply, nil)
			pending := h.take().calls(scripts.FairAcquire)
			if !tc.messageBeforeTryDone {
				message()
			}
			for i := 0; i < 4; i++ {
				pending = append(pending, h.take().calls(scripts.FairAcquire)...)
				if len(pending) == 0 {
					break
				}
				c := pending[0]
				pending = pending[1:]
				h.reply(c, redis.acquire(c), nil)
			}
			h.take()
			mustGranted(t, "a", a.future)
			held := 1 // a
			if err, _ := peek(try); err == nil {
				held++
			}
			hd := h.hold("L", 1)
			if hd == nil || hd.count != redis.count || held != redis.count {
				n := 0
				if hd != nil {
					n = hd.count
				}
				t.Fatalf("Redis counts cid:1 = %d; the engine's hold counts %d, its callers hold %d", redis.count, n, held)
			}
		})
	}
}

// tryFairCtx is tryFair with a context the test can end.
func (h *mh) tryFairCtx(lock string, owner uint64) (uint64, *futures.Future[error], context.CancelFunc, context.Context) {
	ctx, cancel := context.WithCancel(context.Background())
	h.t.Cleanup(cancel)
	h.nextID++
	f := futures.New[error]()
	h.m.handle(acquireMsg{id: h.nextID, lock: lock, owner: owner, fair: true, ctx: ctx,
		stop: func() bool { return true }, future: f}, h.now)
	return h.nextID, f, cancel, ctx
}

// A single try that claims a direct grant made to its handle's queued waiter a
// consumes a's grant, while a stays a live waiter: the grant's message,
// published before the try ran (pub/sub connection), is stale from then on. If it
// comes only after a has joined the Redis queue again, it must not grant a (with
// no call, a would hold in the engine while Redis has no field of owner 1, and
// another process holds the lock): it names a's first registration, and a has
// registered again since.
//
//  1. a (owner 1) is queued, registered, heading the Redis queue; another process
//     holds; process X's waiter is queued behind a.
//  2. owner 1's TryLock T goes (claim "1").
//  3. Redis: the other process's release grants a (cid:1 = 1, publishes
//     leash:grant:<a>); T runs and claims cid:1. T's context ends meanwhile.
//  4. T's reply nil: T is granted (a leaves the local Redis queue:
//     ownerEntryTaken), its grant goes back at once (context ended):
//     lock_release_owner deletes cid:1, X heads the queue and takes the lock.
//  5. a joins again (claim "1"): queued behind X's hold.
//  6. The grant's message for a arrives now: a is granted. Two holders.
func TestMachineFairStaleGrantMessageAfterTryClaimedIt(t *testing.T) {
	h := newMH(t, func(c *config) { c.fairWait = 5 * time.Minute })
	a := h.acquireFair("L", 1)
	join := h.take().one(t, scripts.FairAcquire)
	if join.args[5] == "" {
		t.Fatalf("setup: a's join %v does not register", join.args)
	}
	granted := registeredName(join)               // the registration the release grants to
	h.reply(join, replyPTTL(30*time.Second), nil) // queued, heads the Redis queue
	h.take()

	tryID, tryF, cancel, ctx := h.tryFairCtx("L", 1)
	try := h.take().one(t, scripts.FairAcquire)
	if try.args[6] != "1" {
		t.Fatalf("setup: try %v does not claim", try.args)
	}
	// Redis: the release grants a (cid:1 = 1), then the try claims cid:1.
	cancel()
	h.m.handle(cancelMsg{id: tryID, err: ctx.Err()}, h.now) // in flight: answered at the reply
	h.reply(try, replyNil, nil)
	if err, ok := peek(tryF); !ok || err == nil {
		t.Fatalf("setup: try answered %v, %v; want its context's error", err, ok)
	}
	gb := h.take().one(t, scripts.LockReleaseOwner) // T's grant goes back: cid:1 deleted
	h.now = h.now.Add(time.Millisecond)
	h.reply(gb, replyInt(1), nil) // the lock was deleted; X, now at the head, takes it
	rejoin := h.take().one(t, scripts.FairAcquire)
	h.now = h.now.Add(time.Millisecond)
	h.reply(rejoin, replyPTTL(30*time.Second), nil) // a queued again, behind X's hold
	h.take()

	// Redis holds no field of owner 1. The grant's message, published at step 3,
	// arrives only now.
	h.fairGrantNotice("L", 1, granted)
	h.take()
	if err, ok := peek(a.future); ok && err == nil {
		t.Fatalf("a granted by the stale message of the grant the try claimed (and gave back): " +
			"the engine holds for owner 1 while Redis has no cid:1 field (X holds the lock)")
	}
	if hd := h.hold("L", 1); hd != nil {
		t.Fatalf("engine holds owner 1 (count %d); Redis has no cid:1", hd.count)
	}
}

// The same stale message without a context ending: owner 1's TryLock T claims a's
// grant and is granted while the lock backs off (another local waiter's transport
// error), so a cannot re-enter at once; T's Unlock releases the lock (to c, next in
// the Redis queue); a joins again when the back-off ends, and the grant's message,
// published before T ran, then grants a: a and c both hold.
func TestMachineFairStaleGrantMessageAfterTryClaimedItAndUnlocked(t *testing.T) {
	h := newMH(t, func(c *config) { c.fairWait = 5 * time.Minute })
	a := h.acquireFair("L", 1)
	join := h.take().one(t, scripts.FairAcquire)
	granted := registeredName(join)               // the registration the release grants to
	h.reply(join, replyPTTL(30*time.Second), nil) // a heads the Redis queue
	c := h.acquireFair("L", 3)
	h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil) // c behind a
	h.take()
	// c's retry timer fires; its attempt fails with a transport error: the lock backs off.
	cw := h.m.waiters[c.id]
	h.m.handle(timerFired{key: timerKeyFairRetry(cw.id, cw.retryGen)}, h.now)
	cAtt := h.take().one(t, scripts.FairAcquire)
	h.reply(cAtt, scripts.Reply{}, errConn)
	h.take()
	if !h.lock("L").backingOff {
		t.Fatalf("setup: the lock does not back off")
	}

	try := h.tryFair("L", 1)
	tc := h.take().one(t, scripts.FairAcquire)
	if tc.args[6] != "1" {
		t.Fatalf("setup: try %v does not claim", tc.args)
	}
	// Redis: another process's release grants a (cid:1 = 1, leash:grant:<a>
	// published); T claims cid:1.
	h.reply(tc, replyNil, nil)
	mustGranted(t, "try", try)
	if s := h.take(); len(s.calls(scripts.FairAcquire)) != 0 {
		t.Fatalf("setup: a re-entered at once (%v); this test needs it held off by the back-off", s)
	}
	rel, u := h.unlockCall(t, "L", 1, scripts.FairRelease)
	h.reply(rel, replyInt(1), nil) // released: pass_on grants c (now the head)
	mustGranted(t, "unlock", u)
	h.take()
	h.now = h.now.Add(time.Second)
	h.fire(timerKeyRetry(h.lock("L")))
	var rejoin scriptCall
	for _, call := range h.take().calls(scripts.FairAcquire) {
		if call.waiter == a.id {
			rejoin = call
		}
	}
	if rejoin.waiter == 0 {
		t.Fatalf("setup: a does not join again after the back-off")
	}
	h.reply(rejoin, replyPTTL(30*time.Second), nil) // queued behind c's hold
	// c, woken since its failed attempt, claims the grant T's release made to it.
	for _, call := range h.take().calls(scripts.FairAcquire) {
		if call.waiter == c.id {
			h.reply(call, replyNil, nil)
		}
	}
	mustGranted(t, "c", c.future)
	h.take()
	h.fairGrantNotice("L", 1, granted) // a's first registration's, consumed by T long ago
	h.take()
	if err, ok := peek(a.future); ok && err == nil {
		if h.hold("L", 3) != nil {
			t.Fatalf("a and c both hold: a was granted by the stale message of the grant T claimed")
		}
		t.Fatalf("a granted by the stale message of the grant T claimed; Redis has no cid:1")
	}
}

func timerKeyFairRetry(id, gen uint64) timer.Key {
	return timer.Key{Kind: kindFairRetry, ID: id, Gen: gen}
}

func timerKeyRetry(l *lockState) timer.Key {
	return timer.Key{Kind: kindRetry, ID: l.id, Gen: l.retryGen}
}

// Owner 1's queued waiter a (the watchdog's 30 s lease) is registered for a direct
// grant; the same handle's single try T, with a 1 s lease, claims a's grant on
// Redis, setting its expiry to T's 1 s, and T's reply is lost. a's grant message,
// coming after that, must not grant a as it stands (dated by a's 30 s lease: the
// engine would renew at 10 s while Redis frees the lock about 1 s after T ran): a
// claims the grant with a call instead, which re-applies a's lease.
func TestMachineFairGrantAfterLostTryIsClaimed(t *testing.T) {
	h := newMH(t, func(c *config) { c.fairWait = 5 * time.Minute })
	a := h.acquireFair("L", 1)
	join := h.take().one(t, scripts.FairAcquire)
	granted := registeredName(join)
	h.reply(join, replyPTTL(30*time.Second), nil)
	h.take()
	h.nextID++
	f := futures.New[error]()
	h.m.handle(acquireMsg{id: h.nextID, lock: "L", owner: 1, fair: true, lease: time.Second,
		ctx: context.Background(), future: f}, h.now)
	tc := h.take().one(t, scripts.FairAcquire)
	if tc.args[0] != "1000" {
		t.Fatalf("setup: the try's lease argument is %q, want 1000", tc.args[0])
	}
	// Redis: the release grants a; T claims cid:1 and sets its expiry to 1 s. The
	// reply is lost.
	h.now = h.now.Add(5 * time.Millisecond)
	h.reply(tc, scripts.Reply{}, errConn)
	h.take()
	h.fairGrantNotice("L", 1, granted)
	if err, ok := peek(a.future); ok {
		t.Fatalf("a answered %v by the grant's message with no call; its grant may carry the try's 1 s lease", err)
	}
	claim := h.take().one(t, scripts.FairAcquire)
	if claim.waiter != a.id || claim.args[6] != "1" || claim.args[0] != "30000" {
		t.Fatalf("after the message: call %+v; want a's claim (ARGV[7] \"1\") with its own 30 s lease", claim.args)
	}
	sent := h.now
	h.reply(claim, replyNil, nil) // claimed: cid:1's expiry is a's lease from now on
	h.take()
	mustGranted(t, "a", a.future)
	if hd := h.hold("L", 1); hd == nil || hd.count != 1 || hd.expiresAt.After(sent.Add(30*time.Second)) {
		t.Fatalf("a's hold %+v; want count 1, expiring by the claim's send time + 30 s", hd)
	}
}

// Owner 1's TryLock T1 fails in transit while owner 1's waiter a is in the Redis
// queue but not among the first local waiters: z (owner 9), ahead of it, was
// taken out of the Redis queue when its handle's TryLock claimed z's grant (and
// gave it back, its context having ended). T1 may have run and taken the lock
// (owner 1 headed the Redis queue): that field is a's to claim, so T1's
// clean-up must not delete it. It did once, when ownerQueued looked only at the
// first local waiters: the clean-up (an owner-guarded release of cid:1) went out,
// a's retry re-entered cid:1 (its claim flag was "0" with the owner leaving), and
// the release then deleted it: the engine held for owner 1 while Redis had no key.
func TestMachineFairLostTryLeavesFieldToQueuedWaiterBehindUnqueuedHead(t *testing.T) {
	h := newMH(t, func(c *config) { c.fairWait = 5 * time.Minute })
	z, a, _, gb9 := h.unqueuedHeadBeforeQueued(t)

	t1 := h.tryFair("L", 1)
	t1c := h.take().one(t, scripts.FairAcquire)
	h.reply(t1c, scripts.Reply{}, errConn) // it ran: took the free lock (owner 1 heads the Redis queue)
	mustGet(t, "T1", t1)
	if s := h.take(); len(s.calls(scripts.LockReleaseOwner)) != 0 || len(s.calls(scripts.FairLeave)) != 0 {
		t.Fatalf("T1's clean-up went out (%v) although owner 1's waiter a is in the Redis queue", s)
	}
	// The wake-up for a (the Redis head after T9's give-back), then z joins again.
	h.m.handle(unlockNotice{channel: channelName("L") + ":" + testClientID + ":1", payload: unlockMessage}, h.now)
	h.take()
	h.reply(gb9, replyInt(1), nil)
	zj := h.take().one(t, scripts.FairAcquire)
	if zj.waiter != z.id {
		t.Fatalf("setup: %+v; want z's join", zj)
	}
	h.reply(zj, replyPTTL(30*time.Second), nil)
	var ar scriptCall
	for _, c := range h.take().calls(scripts.FairAcquire) {
		if c.waiter == a.id {
			ar = c
		}
	}
	if ar.waiter == 0 || ar.args[6] != "1" {
		t.Fatalf("a's retry %+v; want one that claims (ARGV[7] \"1\") cid:1, which T1 took", ar.args)
	}
	h.reply(ar, replyNil, nil) // claimed: cid:1 = 1
	h.take()
	mustGranted(t, "a", a.future)
	if hd := h.hold("L", 1); hd == nil || hd.count != 1 {
		t.Fatalf("owner 1's hold %+v; want count 1, as Redis counts", hd)
	}
}

// Owner 1 holds under the watchdog (30 s); a TryLock of the same handle with a 1 s
// lease re-enters, and its reply is lost. If it ran, Redis expires the lock 1 s
// after it ran, while the engine expected 30 s (its next renewal at 10 s): another
// process could take the lock while Lock's caller still believes it holds. The
// hold's expiry is brought forward to what the try may have set, and a renewal goes
// at once, which restores the watchdog's lease. Both lock kinds.
func TestMachineLostShortReentryRenewsTheHold(t *testing.T) {
	for _, fair := range []bool{false, true} {
		t.Run(map[bool]string{false: "Mutex", true: "fair"}[fair], func(t *testing.T) {
			h := newMH(t, func(c *config) { c.fairWait = 5 * time.Minute })
			script := scripts.LockAcquire
			if fair {
				script = scripts.FairAcquire
				a := h.acquireFair("L", 1)
				h.reply(h.take().one(t, script), replyNil, nil)
				h.take()
				mustGranted(t, "a", a.future)
			} else {
				h.grantFresh("L", 1, 0)
			}
			h.now = h.now.Add(time.Second)
			h.nextID++
			f := futures.New[error]()
			h.m.handle(acquireMsg{id: h.nextID, lock: "L", owner: 1, fair: fair, lease: time.Second,
				ctx: context.Background(), future: f}, h.now)
			tc := h.take().one(t, script)
			if tc.args[0] != "1000" {
				t.Fatalf("setup: the re-entry's lease argument is %q, want 1000", tc.args[0])
			}
			sent := h.now
			h.now = h.now.Add(5 * time.Millisecond)
			h.replyAt(tc, sent, scripts.Reply{}, errConn)
			renew := h.take().one(t, scripts.LockRenew)
			hd := h.hold("L", 1)
			if hd == nil || hd.expiresAt.After(sent.Add(time.Second)) {
				t.Fatalf("owner 1's hold %+v: the engine expects it past +1 s, when Redis may expire it", hd)
			}
			renewSent := h.now
			h.now = h.now.Add(time.Millisecond)
			h.replyAt(renew, renewSent, scripts.Reply{Ints: []int64{1}}, nil)
			h.take()
			if want := renewSent.Add(30 * time.Second); !hd.expiresAt.Equal(want) {
				t.Fatalf("after the renewal the hold expires at +%v, want +30s from the renewal", hd.expiresAt.Sub(renewSent))
			}
		})
	}
}

// unqueuedHeadBeforeQueued: another process holds L; z (owner 9) and a (owner 1)
// queue in Redis; then owner 9's TryLock claims z's direct grant with its caller
// gone, so the grant goes back (gb9, not yet answered) and z is the local head,
// out of the Redis queue, ahead of a, in it. It returns z, a, a's join and gb9.
func (h *mh) unqueuedHeadBeforeQueued(t *testing.T) (z, a *tw, aj, gb9 scriptCall) {
	t.Helper()
	z = h.acquireFair("L", 9)
	h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil)
	h.take()
	a = h.acquireFair("L", 1)
	aj = h.take().one(t, scripts.FairAcquire)
	h.reply(aj, replyPTTL(30*time.Second), nil)
	h.take()

	t9ID, t9F, cancel9, ctx9 := h.tryFairCtx("L", 9)
	t9 := h.take().one(t, scripts.FairAcquire)
	cancel9()
	h.m.handle(cancelMsg{id: t9ID, err: ctx9.Err()}, h.now)
	h.reply(t9, replyNil, nil) // claimed z's grant; its caller has gone
	if err, ok := peek(t9F); !ok || err == nil {
		t.Fatalf("setup: T9 answered %v, %v; want its context's error", err, ok)
	}
	gb9 = h.take().one(t, scripts.LockReleaseOwner) // T9's grant goes back
	if zw := h.m.waiters[z.id]; zw == nil || zw.enqueued || h.lock("L").queue.head != zw {
		t.Fatalf("setup: z is not the local head out of the Redis queue")
	}
	return z, a, aj, gb9
}
