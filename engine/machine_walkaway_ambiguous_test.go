package engine

import (
	"testing"

	"github.com/leash-go/leash/internal/scripts"
)

// An Acquire whose caller walked away (its context done, its cancellation not
// yet delivered) has its attempt run on the server and the reply lost. The
// advance that follows that reply prunes the cancelled waiter (finish) while the
// attempt being answered still counts its owner busy: finish took that for
// another call of the owner's in flight, and neither undid the attempt nor
// marked anything maySurplus, so the field stayed on the server, held by nobody,
// until its lease ended (the watchdog's 30 s here). The attempt being answered
// is not in flight any more (ownCalls): the owner-guarded cleanup goes.
func TestMachineWalkedAwayAmbiguousAttemptCleansUp(t *testing.T) {
	h := newMH(t)
	srv := newMemRedis()
	field1 := ownerField(testClientID, 1)
	g := h.acquire("L", 1, 0, -1)
	a := h.take().one(t, scripts.LockAcquire)
	serve(t, srv, a) // it ran: owner 1 holds L on the server
	g.cancel()       // the caller walks away; its cancelMsg is still on its way
	h.reply(a, scripts.Reply{}, errConn)
	serveAll(t, h, srv)
	h.m.handle(cancelMsg{id: g.id, err: g.ctx.Err()}, h.now)
	serveAll(t, h, srv)
	if _, ok := peek(g.future); !ok {
		t.Fatalf("the walked-away Acquire is not answered")
	}
	if h.hold("L", 1) != nil {
		t.Fatalf("owner 1 holds L")
	}
	if n := srv.holders("L")[field1]; n != 0 {
		t.Fatalf("owner 1 holds nothing and nothing is in flight, but the server counts %d under its field (pttl %d ms)", n, srv.pttl("L"))
	}
}
