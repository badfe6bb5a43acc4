package scripts_test

import (
	"strconv"
	"testing"

	"github.com/leash-go/leash/internal/scripts"
)

// TestReleaseDropsRegistrationWhateverItFinds: lock_release with the drop
// (ARGV[6] "1": the caller has no waiter left) deregisters the caller also when
// it frees nothing: a gone field (nil) or a count kept (0). Nothing would drop
// the registration later.
func TestReleaseDropsRegistrationWhateverItFinds(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	g := newGrantEnv(e, "reg-drop")
	g.subscribe(t, grantChannel(g.clientA))
	g.setHash(t, g.key, "x:1=1", 1_000)
	g.register(t, g.clientA, 1)
	rep := g.run(t, scripts.LockRelease, g.keys4, unlockMsg, strconv.Itoa(lease), g.clientA+":1", g.clientA, "0", "1")
	wantReply(t, "lock_release of a gone field", rep, "nil")
	g.wantRegs(t)
	g.register(t, g.clientA, 2)
	g.setHash(t, g.key, g.clientA+":1=2", 1_000)
	rep = g.run(t, scripts.LockRelease, g.keys4, unlockMsg, strconv.Itoa(lease), g.clientA+":1", g.clientA, "0", "1")
	wantReply(t, "lock_release of one of two counts", rep, "0")
	g.wantRegs(t)
	g.wantHash(t, g.key, g.clientA+":1=1")
}

// TestStarLeaveOfListenerLeavesItThePublish: a "*" leave that drops the
// registration of a client still listening on the unlock channel (a new waiter
// registered as it ran) leaves that client a listener that did not register: a
// release elsewhere publishes rather than grants, so the waiter is woken.
func TestStarLeaveOfListenerLeavesItThePublish(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	g := newGrantEnv(e, "reg-star")
	g.subscribe(t, grantChannel(g.clientA))
	g.subscribe(t, channel(g.key)) // a's engine, with a live waiter
	g.setHash(t, g.key, g.cliB+":1=1", 1_000)
	g.register(t, g.clientA, 3)
	wantReply(t, "lock_leave *", g.run(t, scripts.LockLeave, g.keys4, g.clientA, "*", "", unlockMsg, "1", ""), "0")
	g.wantRegs(t)
	w := g.watch(t, g.key)
	rep := g.run(t, scripts.LockRelease, g.keys4, unlockMsg, strconv.Itoa(lease), g.cliB+":1", g.cliB, "0", "0")
	wantReply(t, "b's release", rep, "1")
	w.wantUnlock(t, g.key, true)
}
