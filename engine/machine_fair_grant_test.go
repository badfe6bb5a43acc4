package engine

import (
	"strconv"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// fairHeadRedis models what a fair lock's hash holds for owner 1 (field cid:1) while
// another process holds the lock at first, owner 1's waiter heading the Redis
// queue: enough of fair_acquire.lua and fair_lib.lua's pass_on for the test below.
type fairHeadRedis struct {
	otherHolds bool // the other process's field is there
	count      int  // cid:1's count
}

// release is the other process's fair_release: pass_on grants the registered
// head (owner 1) directly, cid:1 = 1, and publishes "leash:grant:<id>".
func (r *fairHeadRedis) release() { r.otherHolds, r.count = false, 1 }

// acquire runs fair_acquire call c of owner 1.
func (r *fairHeadRedis) acquire(c scriptCall) scripts.Reply {
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
			message := func() {
				h.m.handle(unlockNotice{
					channel: channelName("L") + ":" + testClientID + ":1",
					payload: grantPrefix + strconv.FormatUint(a.id, 10),
				}, h.now)
			}
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
