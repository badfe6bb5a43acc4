// Package timer schedules every deadline in leash — watchdog renewals, lease expiries,
// wait deadlines and TTL retries — on one hashed timing wheel
// (github.com/RussellLuo/timingwheel), behind a three-method interface with a manual
// fake for tests.
//
// A firing is a hint, not a command: it only hands its Key to the sink. The engine
// re-checks the deadline on the monotonic clock and ignores stale generations, because
// the wheel has millisecond resolution, runs on the wall clock, and may fire a
// cancelled entry that was already on its way.
//
// Known limit of running on the wall clock: if the host's clock is stepped back
// (not slewed, as NTP normally does), entries armed before the step fire late by the
// size of the step, and entries armed after it fire early until the wall clock has
// caught up (the engine re-arms those). Hosts should slew, not step, their clocks;
// fair locks need synchronized clocks anyway.
package timer
