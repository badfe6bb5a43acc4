package engine

import (
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// A retried Unlock of a re-entered hold (count 2, the release bounded to keep 1)
// whose retry finds the field gone cannot have deleted it itself: a force-release
// did. The hold keeps a count its caller believes in, so it is lost (Lost closes).
// It was dropped silently instead ("the first try most likely ran"), which also
// drops the recheck a force-release's check had set aside for the Unlock.
//
//  1. F is sent; owner 1 takes L (1 min) and re-enters: count 2.
//  2. Unlock U (keep 1) goes. Redis runs U (count 1), then F (deletes L).
//  3. F's reply (1) sends check C; U's reply is lost: its retry U' goes.
//  4. C runs after F: 0, answered while U' is in flight: set aside (recheck).
//  5. U' finds no field: nil. The hold, count 1, was dropped with Lost open and
//     nothing checking it: its caller still believes it holds L.
func TestMachineForceRetriedUnlockOfReenteredHoldFindsFieldGone(t *testing.T) {
	for _, checkFirst := range []bool{true, false} {
		h := newMH(t)
		f := newForce(h, "L")
		fSent := h.now
		h.now = h.now.Add(time.Millisecond)
		h.grantFresh("L", 1, time.Minute)
		h.acquire("L", 1, time.Minute, -1)
		h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
		h.take()
		hd := h.hold("L", 1)
		if hd.count != 2 {
			t.Fatalf("setup: count %d", hd.count)
		}
		lost := hd.lostSignal().C()
		h.now = h.now.Add(time.Millisecond)
		uc, u := h.unlockCall(t, "L", 1, scripts.LockRelease)
		h.now = h.now.Add(time.Millisecond)
		h.reply(uc, scripts.Reply{}, errConn) // U ran; its reply is lost
		retry := h.take().one(t, scripts.LockRelease)
		if !retry.retried {
			t.Fatalf("setup: not a retry")
		}
		if checkFirst {
			h.replyAt(f, fSent, replyInt(1), nil) // F ran after U
			check := h.take().one(t, scripts.LockRenew)
			h.reply(check, replyInts(0), nil) // C ran after F: set aside for U'
			h.take()
		}
		h.reply(retry, replyNil, nil) // U' ran after F
		mustGet(t, "U", u)
		h.take()
		if !checkFirst {
			h.replyAt(f, fSent, replyInt(1), nil)
			h.take()
		}
		if h.hold("L", 1) == nil {
			select {
			case <-lost:
			default:
				t.Errorf("checkFirst=%v: the hold (count 1 left) was dropped with Lost open; the force-release "+
					"deleted its field, and its caller still believes it holds L", checkFirst)
			}
		}
		if err := mustGet(t, "the outer Unlock", h.unlock("L", 1)); err != errHoldLost {
			t.Errorf("checkFirst=%v: the outer Unlock (its count deleted by the force-release) answered %v, want %v",
				checkFirst, err, errHoldLost)
		}
	}
}
