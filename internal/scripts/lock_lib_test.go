package scripts_test

import (
	"fmt"
	"strconv"
	"testing"

	"github.com/leash-go/leash/internal/scripts"
)

// Direct grants of the reentrant lock (lock_lib.lua): registrations written by
// lock_acquire, granted by lock_release, lock_handoff and lock_leave.

// grantEnv names one lock's keys for the direct-grant scripts. Client ids contain
// "{name}", so a watcher of the lock also sees their grant channels.
type grantEnv struct {
	*env
	key           string
	regs, order   string
	keys4         []string // lock, channel, regs, order
	acquireKeys   []string // lock, regs, order
	clientA, cliB string
}

func newGrantEnv(e *env, key string) grantEnv {
	g := grantEnv{env: e, key: key,
		regs: "leash_lock_reg:{" + key + "}", order: "leash_lock_regq:{" + key + "}",
		clientA: "a{" + key + "}", cliB: "b{" + key + "}"}
	g.keys4 = []string{key, channel(key), g.regs, g.order}
	g.acquireKeys = []string{key, g.regs, g.order}
	return g
}

func grantChannel(cid string) string { return "leash_lock_grant:" + cid }

// reg is a registration value: lease, stamp, waiter id, grant field.
func reg(cid string, id int) string {
	return fmt.Sprintf("%d|%d|%d|%s:%d", leaseB, 100+id, id, cid, 9000+id)
}

// register registers waiter id of cid through a refused lock_acquire.
func (g grantEnv) register(t *testing.T, cid string, id int) {
	t.Helper()
	rep := g.run(t, scripts.LockAcquire, g.acquireKeys, strconv.Itoa(lease), cid+":77", cid, reg(cid, id), fmt.Sprintf("%s:%d", cid, 9000+id))
	if rep.Nil || rep.Int <= 0 {
		t.Fatalf("lock_acquire of %s on a held lock = %s, want a PTTL", cid, show(rep))
	}
}

func (g grantEnv) wantRegs(t *testing.T, want ...string) {
	t.Helper()
	got := g.do(t, "LRANGE", g.order, "0", "-1")
	if w := fmt.Sprint(want); fmt.Sprint(splitLines(got)) != w {
		t.Errorf("registration order %q, want %v", got, want)
	}
	if n := g.doInt(t, "HLEN", g.regs); n != int64(len(want)) {
		t.Errorf("%d registrations, want %d", n, len(want))
	}
}

func splitLines(s string) []string {
	if s == "" {
		return nil
	}
	var out []string
	start := 0
	for i := range len(s) {
		if s[i] == '\n' {
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	return append(out, s[start:])
}

func TestDirectGrantScripts(t *testing.T) {
	t.Parallel()
	e := newEnv(t)

	t.Run("acquire registers, deregisters, claims", func(t *testing.T) {
		g := newGrantEnv(e, "dg-acq")
		g.setHash(t, g.key, "x:1=1", 1_000)
		g.register(t, g.clientA, 1)
		g.wantRegs(t, g.clientA)
		if got := g.do(t, "HGET", g.regs, g.clientA); got != reg(g.clientA, 1) {
			t.Errorf("registration %q, want %q", got, reg(g.clientA, 1))
		}
		g.register(t, g.clientA, 2) // a newer waiter of the same client replaces it
		g.register(t, g.cliB, 3)
		g.wantRegs(t, g.clientA, g.cliB)
		// A grant to b's waiter 3, not heard of: its next attempt claims it.
		g.setHash(t, g.key, g.cliB+":9003=1", 1_000)
		rep := g.run(t, scripts.LockAcquire, g.acquireKeys, strconv.Itoa(lease), g.cliB+":1", g.cliB, reg(g.cliB, 3), g.cliB+":9003")
		wantReply(t, "claiming lock_acquire", rep, "-3")
		g.wantHash(t, g.key, g.cliB+":9003=1")
		g.wantPTTL(t, g.key, lease)
		g.wantRegs(t, g.clientA)
		// Taking a free lock drops the taker's registration.
		g.do(t, "DEL", g.key)
		rep = g.run(t, scripts.LockAcquire, g.acquireKeys, strconv.Itoa(lease), g.clientA+":1", g.clientA, reg(g.clientA, 2), g.clientA+":9002")
		wantReply(t, "lock_acquire of a free lock", rep, "nil")
		g.wantRegs(t)
	})

	t.Run("release grants the oldest live registration of another client", func(t *testing.T) {
		g := newGrantEnv(e, "dg-rel")
		g.subscribe(t, grantChannel("x"))
		g.subscribe(t, grantChannel(g.clientA))
		g.subscribe(t, grantChannel(g.cliB))
		g.subscribe(t, channel(g.key)) // a's and b's engines listen on the lock's channel
		g.subscribe(t, channel(g.key))
		g.setHash(t, g.key, "x:1=1", 1_000)
		g.register(t, "dead{dg-rel}", 1) // nobody listens on its grant channel
		g.register(t, "x", 2)            // the releaser's own
		g.register(t, g.clientA, 3)
		g.register(t, g.cliB, 4)
		w := g.watch(t, g.key)
		rep := g.run(t, scripts.LockRelease, g.keys4, unlockMsg, strconv.Itoa(lease), "x:1", "x", "0", "0")
		wantReply(t, "lock_release", rep, "1")
		g.wantHash(t, g.key, g.clientA+":9003=1")
		g.wantPTTL(t, g.key, leaseB)
		w.want(t, grantChannel(g.clientA)+"=3|103|"+g.key)
		g.wantRegs(t, "x", g.cliB) // the dead one dropped, a's taken
	})

	t.Run("release with nobody else listening publishes nothing", func(t *testing.T) {
		g := newGrantEnv(e, "dg-quiet")
		g.setHash(t, g.key, "x:1=1", 1_000)
		w := g.watch(t, g.key) // a pattern subscription: not counted by NUMSUB
		rep := g.run(t, scripts.LockRelease, g.keys4, unlockMsg, strconv.Itoa(lease), "x:1", "x", "0", "0")
		wantReply(t, "lock_release", rep, "2")
		g.wantHash(t, g.key, "")
		w.want(t)
		// A caller that believes it listens while it does not (its connection
		// being replaced) still publishes to anyone who does.
		g.subscribe(t, channel(g.key))
		g.setHash(t, g.key, "x:1=1", 1_000)
		rep = g.run(t, scripts.LockRelease, g.keys4, unlockMsg, strconv.Itoa(lease), "x:1", "x", "1", "0")
		wantReply(t, "lock_release", rep, "1")
		w.wantUnlock(t, g.key, true)
	})

	t.Run("release yields to a listener that did not register", func(t *testing.T) {
		g := newGrantEnv(e, "dg-yield")
		g.subscribe(t, grantChannel(g.clientA))
		g.subscribe(t, channel(g.key)) // a's engine listens on the lock's channel
		g.subscribe(t, channel(g.key)) // and so does the caller
		g.setHash(t, g.key, "x:1=1", 1_000)
		g.register(t, g.clientA, 1)
		w := g.watch(t, g.key)
		// Listeners besides the caller: a's alone, registered: a grant.
		rep := g.run(t, scripts.LockRelease, g.keys4, unlockMsg, strconv.Itoa(lease), "x:1", "x", "1", "0")
		wantReply(t, "lock_release", rep, "1")
		g.wantHash(t, g.key, g.clientA+":9001=1")
		w.want(t, grantChannel(g.clientA)+"=1|101|"+g.key)
		// A Redisson waiter listens too: the unlock message instead.
		g.subscribe(t, channel(g.key))
		g.setHash(t, g.key, "x:1=1", 1_000)
		g.register(t, g.clientA, 2)
		rep = g.run(t, scripts.LockRelease, g.keys4, unlockMsg, strconv.Itoa(lease), "x:1", "x", "1", "0")
		wantReply(t, "lock_release", rep, "1")
		g.wantHash(t, g.key, "")
		w.wantUnlock(t, g.key, true)
		g.wantRegs(t, g.clientA)
	})

	t.Run("handoff at the bound grants elsewhere and registers the receiver", func(t *testing.T) {
		g := newGrantEnv(e, "dg-hand")
		g.subscribe(t, grantChannel(g.clientA))
		g.setHash(t, g.key, "x:1=1", 1_000)
		g.register(t, g.clientA, 1)
		g.subscribe(t, channel(g.key)) // a's engine
		g.subscribe(t, channel(g.key)) // the caller's
		w := g.watch(t, g.key)
		rep := g.run(t, scripts.LockHandoff, g.keys4, "x:1", strconv.Itoa(lease), "x:2", strconv.Itoa(lease), "1", unlockMsg, "0",
			"x", "1", reg("x", 5))
		wantReply(t, "lock_handoff", rep, "4")
		g.wantHash(t, g.key, g.clientA+":9001=1")
		w.want(t, grantChannel(g.clientA)+"=1|101|"+g.key)
		g.wantRegs(t, "x")
		// Below the bound it hands over locally whatever is registered.
		g.setHash(t, g.key, "x:1=1", 1_000)
		rep = g.run(t, scripts.LockHandoff, g.keys4, "x:1", strconv.Itoa(lease), "x:2", strconv.Itoa(lease), "0", unlockMsg, "0",
			"x", "0", "")
		wantReply(t, "lock_handoff", rep, "2")
		g.wantHash(t, g.key, "x:2=1")
	})

	t.Run("leave deregisters and gives a grant back", func(t *testing.T) {
		g := newGrantEnv(e, "dg-leave")
		g.subscribe(t, grantChannel(g.clientA))
		g.setHash(t, g.key, "x:1=1", 1_000)
		g.register(t, g.clientA, 1)
		g.register(t, g.cliB, 2)
		// b's waiter 2 was granted, and is gone: the leave gives the grant back
		// and passes the lock on to a.
		g.do(t, "HDEL", g.regs, g.cliB)
		g.do(t, "LREM", g.order, "0", g.cliB)
		g.setHash(t, g.key, g.cliB+":9002=1", 1_000)
		w := g.watch(t, g.key)
		rep := g.run(t, scripts.LockLeave, g.keys4, g.cliB, "2", g.cliB+":9002", unlockMsg, "0", "")
		wantReply(t, "lock_leave", rep, "1")
		g.wantHash(t, g.key, g.clientA+":9001=1")
		w.want(t, grantChannel(g.clientA)+"=1|101|"+g.key)
		// A leave of a waiter the registration no longer names keeps it, and one
		// that names it drops it (writing the next waiter's in its place).
		g.setHash(t, g.key, "x:1=1", 1_000)
		g.register(t, g.cliB, 3)
		wantReply(t, "lock_leave", g.run(t, scripts.LockLeave, g.keys4, g.cliB, "2", g.cliB+":9002", unlockMsg, "0", ""), "0")
		g.wantRegs(t, g.cliB)
		wantReply(t, "lock_leave", g.run(t, scripts.LockLeave, g.keys4, g.cliB, "3", g.cliB+":9003", unlockMsg, "0", reg(g.cliB, 4)), "0")
		if got := g.do(t, "HGET", g.regs, g.cliB); got != reg(g.cliB, 4) {
			t.Errorf("registration after the leave %q, want the next waiter's %q", got, reg(g.cliB, 4))
		}
		g.wantHash(t, g.key, "x:1=1")
		// A leave naming no waiter ("*") drops the caller's registration whatever
		// waiter it names, and nothing else: not another client's, not the lock.
		g.register(t, g.clientA, 5)
		wantReply(t, "lock_leave", g.run(t, scripts.LockLeave, g.keys4, g.cliB, "*", "", unlockMsg, "0", ""), "0")
		g.wantRegs(t, g.clientA)
		g.wantHash(t, g.key, "x:1=1")
		wantReply(t, "lock_leave", g.run(t, scripts.LockLeave, g.keys4, g.cliB, "*", "", unlockMsg, "0", ""), "0")
		g.wantRegs(t, g.clientA)
	})
}
