package engine

import (
	"testing"
	"time"
)

// The two-client simulation: the simulation of machine_sim_test.go with two
// machines, clients "A" and "B" (fields "A:<owner>" and "B:<owner>"), on one
// plain lock and one memRedis. Client A has two handles shared by two
// goroutines each, client B one handle shared by two; each machine has its own
// calls in flight, timers and subscriptions. One fake clock moves both machines
// and the server together, and a timer whose time has come, on either machine,
// fires before anything else; the clock moves on by a microsecond at every step,
// so that no two steps read the same time. The server runs and answers either
// machine's calls in any order, losing replies as before; an unlock message
// reaches each machine that has asked to subscribe to the lock's channel (one
// notice per machine, each delivered late and in any order). The grant
// channel's subscription is never confirmed, so no grant is direct.
//
// After every step it checks, for each machine, the per-hold invariant of the
// one-machine simulation (sim.violation), and mutual exclusion
// (simWorld.exclusion): no two goroutines of different handles, in one client
// or in two, count on live holds at once.
//
// With bf4692f's fix to runCleanup reverted, it fails at seed 410 (the per-hold
// check; the exclusion check alone first fails at seed 4735, two handles of A
// inside at once); about one seed in a thousand meets that bug. LEASH_SIM_SEEDS
// (a count) and LEASH_SIM_FIRST (the first seed) run more of them.

// simClientsSeeds is how many seeds a default run of the two-client simulation
// tries: about 4 s under -race here.
const simClientsSeeds = 500

// runSimClients runs one seed of the two-client simulation and returns the first
// violation ("" if none) and the trace.
func runSimClients(t *testing.T, seed uint64) (string, []string) {
	w := newSimWorld(seed, true)
	w.tick = time.Microsecond
	w.mix = 4 + w.rnd.IntN(10)
	w.addNode(t, "A ", 4, 2, func(c *config) { c.clientID = "A" })
	w.addNode(t, "B ", 2, 1, func(c *config) { c.clientID = "B" })
	return w.run()
}

// TestMachineSimTwoClients runs the two-client simulation (see the top of the
// file) for simClientsSeeds seeds, and on a violation logs the seed's trace.
func TestMachineSimTwoClients(t *testing.T) {
	runSimSeeds(t, simClientsSeeds, runSimClients)
}
