package engine

import (
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// An Unlock whose first try failed with scripts.ErrReordered did not run (the
// server refused it: NOSCRIPT). A retry that then finds the owner's field gone
// shows the hold was gone before this Unlock released anything: it must answer as
// an unretried Unlock would (ErrNotHeld / lost), not nil ("the first try most
// likely ran"). With count 2 the caller is told its release succeeded, then lost.
func TestMachineUnlockRetriedAfterReorderedFindsFieldGone(t *testing.T) {
	for _, count := range []int{1, 2} {
		h := newMH(t)
		h.grantFresh("L", 1, time.Minute)
		if count == 2 {
			h.acquire("L", 1, time.Minute, -1)
			h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
			h.take()
		}
		h.now = h.now.Add(time.Millisecond)
		uc, u := h.unlockCall(t, "L", 1, scripts.LockRelease)
		h.reply(uc, scripts.Reply{}, scripts.ErrReordered) // did not run
		retry := h.take().one(t, scripts.LockRelease)
		h.reply(retry, replyNil, nil) // the field was gone (another client's force-release)
		if err := mustGet(t, "U", u); err == nil {
			t.Errorf("count %d: the Unlock, which released nothing (its first try did not run, the retry found no field), answered nil", count)
		}
	}
}
