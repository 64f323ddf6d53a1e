// pgflow dashboard: refreshes each page's live part (an element with data-refresh) without a full reload.
(function () {
  "use strict";
  // A refresh keeps what the user chose: the values of the named controls they changed are set again in the
  // new content (where it still offers them), and a control they are using is not replaced at all.
  document.querySelectorAll("[data-refresh]").forEach(function (el) {
    var every = parseInt(el.getAttribute("data-every"), 10) || 2000;
    var busy = false;
    var chosen = {};
    el.addEventListener("change", function (e) {
      if (e.target.name) chosen[e.target.name] = e.target.value;
    });
    setInterval(function () {
      var active = document.activeElement;
      var editing = active && el.contains(active) && /^(SELECT|INPUT|TEXTAREA)$/.test(active.tagName);
      if (busy || document.hidden || editing) return;
      busy = true;
      fetch(el.getAttribute("data-refresh"), { credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) {
          if (html !== null) {
            el.innerHTML = html;
            Object.keys(chosen).forEach(function (name) {
              var control = el.querySelector("[name='" + name + "']");
              var offered = control && (control.tagName !== "SELECT" ||
                Array.prototype.some.call(control.options, function (o) { return o.value === chosen[name]; }));
              if (offered) control.value = chosen[name];
            });
            el.setAttribute("data-refreshed", String(Date.now()));
          }
        })
        .catch(function () {})
        .then(function () { busy = false; });
    }, every);
  });
})();
