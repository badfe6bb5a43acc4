package engine

import (
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// A waiter registers for direct grants only while its client listens on the
// lock's unlock channel: lock_lib.lua counts every live registration as a
// listener on that channel ("grant only when every other listener is a
// registered leash client"), so a registration of a client whose subscription is
// still on its way (or failed) makes a release grant to it while a Redisson
// waiter, the one real listener, hears nothing.
func TestMachineNoRegistrationBeforeUnlockSubscription(t *testing.T) {
	for _, failed := range []bool{false, true} {
		name := "subscribing"
		if failed {
			name = "subscribe-failed"
		}
		t.Run(name, func(t *testing.T) {
			h := withGrants(t)
			h.acquire("L", 1, 0, -1)
			first := h.take().one(t, scripts.LockAcquire)
			// Held elsewhere, with little lease left: the retry comes before the
			// subscription is confirmed.
			h.reply(first, replyPTTL(5*time.Millisecond), nil)
			s := h.take()
			if len(s.subscribes()) != 1 {
				t.Fatalf("want the lock's subscription sent: %v", s)
			}
			retry := s.retryArmed(t)
			if failed {
				h.m.handle(subscribeDone{lock: h.lockID("L"), err: errConn}, h.now)
				retry = h.take().retryArmed(t)
			}
			if st := h.lock("L").sub; st == subSubscribed {
				t.Fatalf("setup: subscription %v", st)
			}
			h.fire(retry.key)
			att := h.take().one(t, scripts.LockAcquire)
			if len(att.args) > 2 {
				t.Fatalf("attempt args %q register the waiter while its client does not listen on the unlock channel (sub %v)",
					att.args, h.lock("L").sub)
			}
		})
	}
}
